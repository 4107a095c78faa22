"""Packed micro-batches (megarl.megatron.packing) on real megatron-core over gloo.

- Logprobs of rows of very different lengths (2 to 40 tokens), packed into one micro-batch (two at PP2 and VPP, so
  the pipeline passes packs of different lengths), equal HF transformers' on the padded rows within the derived
  float32 bound (tests/helpers/bounds.py, megarl.numerics: what `megarl verify` uses), for a dense model with QK norm
  (qwen3) at TP1, TP2 with sequence parallelism (the pack padded at its end to a multiple of TP), PP2 and PP2 x VPP2,
  and an MoE (qwen3_moe) at EP2 and TP2 x EP2 (sequence parallel: token dispatch over a pack), and at EP2 with each
  rank's own rows (packs of different lengths, padded to the same token count for the expert dispatch); nothing is
  computed past a row's length (its outputs are 0).
- Where pack sizes are agreed (EP2, PP2 x VPP2) the end padding computes no attention and reaches no expert (counted
  against the rows by hand), 64 more padding tokens per pack leave the PPO step unchanged within the derived bounds,
  and at EP2 the workers' forward-only passes with rows dealt over the ranks by tokens (token budgets agreed over the
  group, fixed micro-batches) equal every row computed on every rank, and the worker's update (the same, in token
  budgets and in the fewest packs) equals the step of two rows per rank.
- One PPO update with packed micro-batches equals the same update computed on the padded micro-batches (the model
  run on [b, S] with a causal mask, the loss on its padded logits), at TP1 and TP2: loss, grad norm and every
  parameter after the step within bounds derived below from the forward bound, the gradients' relative rounding
  and Adam's step.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import ADAM_EPS, assert_same_ppo_step, logprob_bound
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model

pytestmark = pytest.mark.parity
SEQ = 40
LENGTHS = [40, 2, 17, 4]  # very different lengths; 63 tokens: an odd pack, padded at its end under TP2 x SP


def _tokens(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 120, (len(LENGTHS), SEQ), generator=g)
    lengths = torch.tensor(LENGTHS)
    tokens[torch.arange(SEQ)[None, :] >= lengths[:, None]] = 0  # right padding
    return tokens, lengths


def packed_rank(models: dict, tokens, lengths, tp: int, pp: int, ep: int, vpp, sequence_parallel, micro: int,
                cp: int = 1):
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, virtual_pipeline_model_parallel_size=vpp,
                               context_parallel_size=cp), seed=123)
    out = {}
    for arch, hf_dir in models.items():
        model, _ = build_and_load(hf_dir, dtype=torch.float32, sequence_parallel=sequence_parallel)
        for chunk in model if isinstance(model, list) else [model]:
            chunk.eval()
        out[arch] = token_logprobs(model, tokens, micro_batch_size=micro, lengths=lengths)
    return out


def tiny_models(root, archs):
    """(models {arch: dir}, tokens, lengths, mask, refs {arch: (HF logprobs, derived bound)}) of random tiny models."""
    tokens, lengths = _tokens()
    mask = torch.arange(SEQ - 1)[None, :] < (lengths[:, None] - 1)
    models, refs = {}, {}
    for i, arch in enumerate(archs):
        models[arch] = str(make_tiny_model(arch, root / arch, seed=i))
        refs[arch] = (hf_logprobs(models[arch], tokens), logprob_bound(models[arch], tokens, mask))
    return models, tokens, lengths, mask, refs


def check_equal_hf(results: list, refs: dict, mask, label: str) -> int:
    """Every rank's {arch: logprobs [B, S-1] or None} within the derived bound of HF's; returns how many were checked."""
    checked = 0
    for r in results:
        for arch, got in r.items():
            if got is None:  # off the last pipeline stage
                continue
            ref, tol = refs[arch]
            assert got.shape == (len(LENGTHS), SEQ - 1)
            diff = ((got - ref).abs() * mask).max().item()
            print(f"[measured] {label} {arch}: vs HF {diff:.2e} (bound {tol:.2e}, margin {tol / diff:.0f}x)")
            assert diff < tol, (arch, diff, tol)
            assert (got[~mask] == 0).all()  # nothing past a row's last real token
            checked += 1
    return checked


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("packing"), ("qwen3", "qwen3_moe"))


# (id, tp, pp, ep, vpp, sequence_parallel, micro-batch rows, architectures)
# (id, tp, pp, ep, vpp, sequence_parallel, micro-batch rows, architectures); each launch takes about 50 s on 2 cores:
# the default suite runs TP1, VPP (which pipelines too) and EP2, the others are marked slow
SLOW = pytest.mark.slow
LAYOUTS = [
    ("tp1", 1, 1, 1, None, None, 4, ("qwen3", "qwen3_moe")),
    pytest.param("tp2_sp", 2, 1, 1, None, True, 4, ("qwen3",), marks=SLOW, id="tp2_sp"),
    pytest.param("pp2", 1, 2, 1, None, None, 2, ("qwen3",), marks=SLOW, id="pp2"),
    # the AVX2 tier keeps tp1 (dense and MoE): the other layouts run its kernels (parity_repeat)
    pytest.param("vpp", 1, 2, 1, 2, None, 2, ("qwen3",), marks=pytest.mark.parity_repeat, id="vpp"),
    pytest.param("ep2", 1, 1, 2, None, None, 4, ("qwen3_moe",), marks=pytest.mark.parity_repeat, id="ep2"),
    pytest.param("tp2ep2_sp", 2, 1, 2, None, True, 4, ("qwen3_moe",), marks=SLOW, id="tp2ep2_sp"),
]


@pytest.mark.parametrize("name,tp,pp,ep,vpp,sp,micro,archs", LAYOUTS,
                         ids=[x[0] if isinstance(x, tuple) else x.id for x in LAYOUTS])
def test_packed_logprobs_equal_hf(tiny, name, tp, pp, ep, vpp, sp, micro, archs):
    models, tokens, lengths, mask, refs = tiny
    results = run_ranks(f"{__name__}:packed_rank", tp * pp * ep,
                        {"models": {a: models[a] for a in archs}, "tokens": tokens, "lengths": lengths, "tp": tp,
                         "pp": pp, "ep": ep, "vpp": vpp, "sequence_parallel": sp, "micro": micro}, timeout=420)
    assert check_equal_hf(results, refs, mask, f"{name} packed") >= len(archs)


def own_rows_rank(hf_dir: str, tokens, lengths):
    """EP2 over 2 ranks (DP2 for attention): each rank its own two rows, packs of 42 and 21 tokens."""
    import torch.distributed as dist

    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(expert_model_parallel_size=2), seed=123)
    model, _ = build_and_load(hf_dir, dtype=torch.float32)
    model.eval()
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    return rows, token_logprobs(model, tokens[rows], micro_batch_size=2, lengths=lengths[rows])


@pytest.mark.parity_repeat
def test_packs_of_different_lengths_on_expert_parallel_ranks(tiny):
    """megatron's allgather token dispatcher gathers equal parts from every EP rank: the shorter pack is padded at
    its end to the longer one's length (packing.agreed_sizes), and each rank's rows still equal HF's."""
    models, tokens, lengths, mask, refs = tiny
    ref, tol = refs["qwen3_moe"]
    for rows, got in run_ranks(f"{__name__}:own_rows_rank", 2, {"hf_dir": models["qwen3_moe"], "tokens": tokens,
                                                                 "lengths": lengths}, timeout=420):
        diff = ((got - ref[rows]).abs() * mask[rows]).max().item()
        print(f"[measured] ep2, own rows {rows}: packed vs HF {diff:.2e} (bound {tol:.2e})")
        assert diff < tol, (rows, diff, tol)


N, LR = 4, 1e-3


def _batch(hf_dir):
    tokens, lengths = _tokens(seed=7)
    mask = torch.zeros(N, SEQ - 1, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, max(0, n // 2 - 1): n - 1] = True  # "response" = the second half of each row
    g = torch.Generator().manual_seed(5)
    # on-policy old logprobs (HF's): every ratio is 1 up to rounding, far from the clip edges, so the loss is
    # a smooth function of the logprobs and its difference is bounded by theirs
    return {"input_ids": tokens, "response_mask": mask, "old_log_probs": hf_logprobs(hf_dir, tokens),
            "advantages": torch.randn(N, SEQ - 1, generator=g)}


def padded_forward_step(loss_fn, scale, data_iterator, model):
    """The padded micro-batch as before packing: the model on [b, S] with a causal mask; its logits [b, S, V/TP]
    are the pack of full-width rows in row-major order, which the loss reads like any pack."""
    from functools import partial

    from megarl import distributed
    from megarl.megatron.forward import causal_inputs
    from megarl.megatron.packing import pack_rows
    from megarl.megatron.train_step import _scaled_loss

    mb = distributed.to_device(next(data_iterator))
    pos, mask = causal_inputs(mb["input_ids"])
    out = distributed.call_model(model, mb["input_ids"], pos, mask)
    full = {**mb, "pack": pack_rows(mb["input_ids"])}
    return out, lambda output: partial(_scaled_loss, loss_fn, scale, full)(output.reshape(1, -1, output.shape[-1]))


def step_rank(hf_dir, batch, tp: int, padded: bool, cp: int = 1):
    from megarl.config.schema import OptimConfig
    from megarl.megatron import train_step
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp, context_parallel_size=cp), seed=0)
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    trainable = train_step.make_trainable(model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0, clip_grad=0.0),
                                          total_steps=10)
    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]  # two micro-batches of 2 rows
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    denominator = train_step.loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    if padded:
        train_step.forward_step = padded_forward_step
    metrics = train_step.train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
    params = {n: p.detach().clone() for n, p in trainable.chunks[0].module.named_parameters()}
    return {"metrics": metrics, "params": params}


@pytest.mark.slow  # two launches of about 50 s each
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_packed_step_equals_padded_step(tmp_path, tp):
    hf_dir = str(make_tiny_model("qwen3", tmp_path / "qwen3", seed=2))
    batch = _batch(hf_dir)
    runs = {padded: run_ranks(f"{__name__}:step_rank", tp, {"hf_dir": hf_dir, "batch": batch, "tp": tp,
                                                            "padded": padded}, timeout=420)
            for padded in (False, True)}
    # bounds derived in tests.helpers.bounds.assert_same_ppo_step
    assert_same_ppo_step(f"tp{tp} packed vs padded", hf_dir, batch, runs[False], runs[True], LR, tp)


def padded_step_rank(hf_dir, batch, ep: int, pp: int, vpp, extra: int):
    """One PPO step twice on this rank's micro-batches: at the pack sizes megarl agrees on ("agreed": at EP2 the
    shorter rank's pack is padded to its peer's, under VPP every pack to the call's longest) and with `extra` more
    padding tokens at the end of every pack ("padded"). Each returns the step's metrics and parameters, the attention
    score entries computed (SDPA calls: batch x heads x queries x keys) and the tokens the experts received."""
    import torch.nn.functional as F

    from megarl.config.schema import OptimConfig
    from megarl.megatron import packing, train_step
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megatron.core import parallel_state as ps

    init_model_parallel(Layout(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                               virtual_pipeline_model_parallel_size=vpp), seed=0)
    if ep > 1:  # each data-parallel (= expert-parallel) rank its own two rows, one per micro-batch
        r = ps.get_data_parallel_rank()
        micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in (2 * r, 2 * r + 1)]
    else:  # the interleaved schedule: micro-batches in groups of PP
        micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    agreed, sdpa = packing.agreed_sizes, F.scaled_dot_product_attention
    out = {}
    for name, add in (("agreed", 0), ("padded", extra)):
        counts = {"attention": 0, "experts": 0}

        def counting(q, k, v, **kw):
            counts["attention"] += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
            return sdpa(q, k, v, **kw)

        def received(module, args):
            counts["experts"] += int(torch.as_tensor(args[1]).sum())

        F.scaled_dot_product_attention = counting
        packing.agreed_sizes = lambda sizes, add=add: [s + add for s in agreed(sizes)]
        model, spec = build_and_load(hf_dir, dtype=torch.float32)
        chunks = model if isinstance(model, list) else [model]
        for chunk in chunks:
            for module in chunk.modules():
                if type(module).__name__ == "MoELayer":
                    module.experts.register_forward_pre_hook(received)
        trainable = train_step.make_trainable(model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0,
                                                                 clip_grad=0.0), total_steps=10)
        settings = PolicyLossSettings(vocab_size=spec.vocab_size)
        denominator = train_step.loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
        try:
            metrics = train_step.train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
        finally:
            F.scaled_dot_product_attention, packing.agreed_sizes = sdpa, agreed
        params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(trainable.chunks)
                  for n, p in c.module.named_parameters()}
        out[name] = {"metrics": metrics, "params": params, **counts}
    out["layers"] = sum(len(c.module.decoder.layers) for c in trainable.chunks)
    out["spec"] = (spec.num_attention_heads, spec.moe_topk)
    if ep > 1:  # the forward-only passes as the workers run them: rows dealt over the ranks by tokens
        out["forwards"] = worker_forwards(model, batch)
        for name, budget in (("worker, budget", 60), ("worker, fixed", None)):
            out[name] = worker_update(hf_dir, batch, budget)
    return out


def worker_update(hf_dir, batch, budget):
    """The same PPO step through the actor worker's update (megarl.megatron.workers._Worker._update) at EP2, the rows
    in another order: the mini-batch's rows dealt over the DP ranks by tokens, then token budgets of `budget` tokens
    with their count agreed over the expert-parallel group, or (None) fixed micro-batches of one row dealt into the
    fewest packs."""
    from functools import partial
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from megarl.config.schema import OptimConfig
    from megarl.megatron import train_step, workers
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load

    # rows 40, 17 | 2, 4 tokens: dealt by tokens 40, 2 | 17, 4, in one budget micro-batch each
    batch = {k: v[torch.tensor([0, 2, 1, 3])] for k, v in batch.items()}
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    worker = object.__new__(workers.PolicyWorker)
    worker.model = model
    worker.trainable = train_step.make_trainable(model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0,
                                                                    clip_grad=0.0), total_steps=10)
    rt = SimpleNamespace(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    metrics = worker._update(batch, rt, N, 1, 1, None, settings.loss_agg_mode, partial(PolicyLoss, settings),
                             budget)
    params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(worker.trainable.chunks)
              for n, p in c.module.named_parameters()}
    return {"metrics": metrics, "params": params}


def worker_forwards(model, batch) -> dict:
    """Old logprobs [N, S-1] of the whole batch as megarl's workers compute them at EP2 (megarl.megatron.workers.
    _forward_only: the rows dealt over the DP ranks by tokens, gathered back in row order), in token budgets (their
    count agreed over the expert-parallel group) and in fixed micro-batches of one row."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from megarl.megatron import workers
    from megarl.megatron.forward import token_logprobs

    for chunk in model if isinstance(model, list) else [model]:
        chunk.eval()
    # rows 40, 17 | 2, 4 tokens: the contiguous shares would be 57 | 6 tokens, dealt by tokens 42 | 21
    order = torch.tensor([0, 2, 1, 3])
    batch = {k: v[order] for k, v in batch.items()}
    rt = SimpleNamespace(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())
    out = {}
    for dynamic in (True, False):
        cfg = SimpleNamespace(rollout=SimpleNamespace(log_prob_use_dynamic_bsz=dynamic,
                                                      log_prob_max_token_len_per_gpu=24),
                              parallelism=SimpleNamespace(context_parallel_size=1))
        out["budget" if dynamic else "fixed"] = workers._forward_only(
            cfg, rt, batch, lambda x, mb, lens: token_logprobs(model, x, mb, lengths=lens), 1, SEQ - 1)
    # the reference: every rank all rows, in row order, one per micro-batch (no dealing, nothing to restore)
    with torch.no_grad():
        out["all rows"] = token_logprobs(model, batch["input_ids"], 1, lengths=torch.tensor(LENGTHS)[order])
    out["order"] = order
    return out


@pytest.mark.parametrize("layout", [
    pytest.param(("ep2", "qwen3_moe", 2, 1, None), id="ep2"),  # about 25-45 s each on 2 busy cores
    pytest.param(("vpp", "qwen3", 1, 2, 2), id="vpp"),
])
def test_end_padding_costs_nothing_and_changes_no_step(tmp_path, layout):
    """Where pack sizes are agreed (EP2: per micro-batch across the expert-parallel ranks; VPP: every pack of a call
    to the longest) the end padding computes no attention and reaches no expert: the score entries computed are
    heads x sum of squared row lengths per layer, the tokens the experts receive topk x the real tokens per layer
    (counted by hand from the rows, padding excluded), the same with 64 more padding tokens per pack. The step with
    that padding equals the step without it within the bounds derived in assert_same_ppo_step (the same sums on the
    same rows; only the order of float additions may differ)."""
    label, arch, ep, pp, vpp = layout
    hf_dir = str(make_tiny_model(arch, tmp_path / arch, seed=2))
    batch = _batch(hf_dir)
    ranks = run_ranks(f"{__name__}:padded_step_rank", 2, {"hf_dir": hf_dir, "batch": batch, "ep": ep, "pp": pp,
                                                          "vpp": vpp, "extra": 64}, timeout=600)
    heads, topk = ranks[0]["spec"]
    layers = sum(r["layers"] for r in ranks) // (1 if pp > 1 else len(ranks))  # per model replica
    real = [int(n) for n in LENGTHS]
    for name in ("agreed", "padded"):
        attention = sum(r[name]["attention"] for r in ranks)
        # every layer's attention over every row once (EP2: each rank its own rows; VPP: each layer on one rank)
        assert attention == layers * heads * sum(n * n for n in real), (name, attention)
        if ep > 1:
            experts = sum(r[name]["experts"] for r in ranks)
            assert experts == layers * topk * sum(real), (name, experts)
    print(f"[measured] {label}: attention score entries {attention}, expert tokens "
          f"{sum(r['padded']['experts'] for r in ranks)} with 64 padding tokens per pack; pack tokens agreed "
          f"{[r['agreed']['metrics']['pack_tokens'] for r in ranks]}, padded "
          f"{[r['padded']['metrics']['pack_tokens'] for r in ranks]}")
    assert all(r["padded"]["metrics"]["pack_tokens"] > r["agreed"]["metrics"]["pack_tokens"] for r in ranks)
    if ep > 1:  # after the step: the forward-only passes of the stepped model, rows dealt over the ranks by tokens
        mask = batch["response_mask"][ranks[0]["forwards"]["order"]]
        for kind in ("budget", "fixed"):
            a, b = (r["forwards"][kind] for r in ranks)
            assert a.shape == (N, SEQ - 1) and torch.equal(a, b)  # gathered on every rank, in row order
        ref, tol = ranks[0]["forwards"]["all rows"], logprob_bound(hf_dir, batch["input_ids"], mask)
        for kind in ("budget", "fixed"):
            diff = ((ranks[0]["forwards"][kind] - ref).abs() * mask).max().item()
            print(f"[measured] {label}: {kind} micro-batches, rows dealt over the ranks, vs every row on every rank "
                  f"{diff:.2e} (bound {tol:.2e})")
            assert diff < tol, (kind, diff, tol)
    assert_same_ppo_step(f"{label}: 64 more padding tokens per pack vs the agreed sizes", hf_dir, batch,
                         [r["agreed"] for r in ranks], [r["padded"] for r in ranks], LR)
    if ep > 1:  # the worker's update: other rows on each rank, other packs, the same global step
        for name in ("worker, budget", "worker, fixed"):
            assert_same_ppo_step(f"{label}: {name} vs two rows per rank", hf_dir, batch,
                                 [r["agreed"] for r in ranks], [r[name] for r in ranks], LR)
