"""Packed micro-batches (megarl.megatron.packing) on real megatron-core over gloo.

- Logprobs of rows of very different lengths (2 to 40 tokens), packed into one micro-batch (two at PP2 and VPP, so
  the pipeline passes packs of different lengths), equal HF transformers' on the padded rows within the derived
  float32 bound (tests/helpers/bounds.py, megarl.numerics: what `megarl verify` uses), for a dense model with QK norm
  (qwen3) at TP1, TP2 with sequence parallelism (the pack padded at its end to a multiple of TP), PP2 and PP2 x VPP2,
  and an MoE (qwen3_moe) at EP2 and TP2 x EP2 (sequence parallel: token dispatch over a pack), and at EP2 with each
  rank's own rows (packs of different lengths, padded to the same token count for the expert dispatch); nothing is
  computed past a row's length (its outputs are 0).
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
