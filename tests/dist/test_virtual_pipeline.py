"""Virtual pipeline stages (interleaved 1F1B) at PP2 x VPP2 on 2 ranks, tiny 4-layer models (one layer per chunk).

- Logprobs equal HF transformers' within the derived float32 bound (tests/helpers/bounds.py) and HF -> megarl ->
  export is bitwise the input checkpoint,
  for a dense model with tied embeddings and QKV bias (qwen2: the embedding and the tied head sit on different
  chunks of different ranks) and an MoE (qwen3_moe).
- One PPO update at PP2 x VPP2 equals the same update at PP2 without virtual stages (float32): loss, grad norm,
  the logprobs after the update and every exported weight. Both layouts run in the same two processes (megatron's
  parallel state is rebuilt in between), and the PP2 result is itself checked against plain torch on the HF model.
- A PP2 x VPP2 checkpoint (actor and critic) merges to HF: transformers equals the saving model.
Slow: the checkpoint resumes at PP2 without virtual stages (same model, same next Adam step); the weight sync from
PP2 x VPP2 chunks into a vLLM engine after an update (engine logprobs equal the actor's, bytes equal the plan's).
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_bridge_parity import round_trip_problems
from tests.helpers.bounds import logprob_bound
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
SEQ, N, MICRO = 24, 4, 1
PARITY_ARCHS = ("qwen2", "qwen3_moe")


def vpp_parity_rank(models: dict, tokens) -> dict:
    from megarl.bridge import export_to_dict
    from megarl.bridge.sharding import local_params
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), seed=123)
    out = {}
    for arch, hf_dir in models.items():
        model, spec = build_and_load(hf_dir, dtype=torch.float32)
        assert isinstance(model, list) and len(model) == 2
        for chunk in model:
            chunk.eval()
        # which global layers each chunk holds (megatron's interleaved placement)
        layers = [sorted({int(p.name.split(".")[2]) for p in local_params(c) if p.name.startswith("decoder.layers.")})
                  for c in model]
        # 3 micro-batches of 1 row: run_microbatches pads the count to a multiple of PP for the interleaved schedule
        logprobs = token_logprobs(model, tokens[:3], micro_batch_size=MICRO)
        # 4 rows asked in one micro-batch of 4: run as 2 micro-batches of 2 (a count of PP)
        whole = token_logprobs(model, tokens, micro_batch_size=4)
        problems = round_trip_problems(export_to_dict(model, spec, bucket_bytes=64 << 10), hf_dir)
        out[arch] = (logprobs, problems, layers, whole)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vpp_models")
    tokens, lengths = sample_tokens(N, SEQ, seed=3)
    models = {a: str(make_tiny_model(a, root / a, seed=i)) for i, a in enumerate(PARITY_ARCHS)}
    return models, tokens, lengths


def test_logprob_parity_and_round_trip_pp2_vpp2(tiny):
    models, tokens, lengths = tiny
    results = run_ranks(f"{__name__}:vpp_parity_rank", 2, {"models": models, "tokens": tokens}, timeout=600)
    mask = torch.arange(SEQ - 1)[None, :] < (lengths[:3, None] - 1)
    for arch, hf_dir in models.items():
        ref = hf_logprobs(hf_dir, tokens[:3])
        # megatron's interleaved placement: rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3
        assert [r[arch][2] for r in results] == [[[0], [2]], [[1], [3]]], [r[arch][2] for r in results]
        reporting = [r[arch][0].cpu() for r in results if r[arch][0] is not None]
        assert len(reporting) == 1, f"{arch}: {len(reporting)} ranks reported logprobs (the last stage should)"
        assert reporting[0].shape == (3, SEQ - 1)
        worst = ((reporting[0] - ref).abs() * mask).max().item()
        tol = logprob_bound(hf_dir, tokens[:3], mask)
        print(f"[pp2 x vpp2] {arch}: max |logprob diff| vs HF = {worst:.2e} (bound {tol:.2e})")
        assert worst < tol, f"{arch}: max abs logprob diff {worst:.3e} >= derived bound {tol:.3e}"
        whole = next(r[arch][3].cpu() for r in results if r[arch][3] is not None)
        full_mask = torch.arange(SEQ - 1)[None, :] < (lengths[:, None] - 1)
        worst = ((whole - hf_logprobs(hf_dir, tokens)).abs() * full_mask).max().item()
        tol = logprob_bound(hf_dir, tokens, full_mask)
        print(f"[pp2 x vpp2] {arch}: one micro-batch of 4 rows vs HF = {worst:.2e} (bound {tol:.2e})")
        assert worst < tol, (arch, worst, tol)
        for rank, r in enumerate(results):
            assert r[arch][1] == [], f"{arch}, rank {rank}: round trip problems {r[arch][1][:10]}"


def vpp_step_rank(hf_dir: str, batch: dict) -> dict:
    """One PPO update at PP2, then (parallel state rebuilt, model reloaded) at PP2 x VPP2: both results."""
    import torch.distributed as dist

    from megarl.bridge.exporter import export_to_dict
    from megarl.config.schema import OptimConfig
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from tests.dist.test_actor_step import CLIP_HIGH, CLIP_LOW, LR

    out = {}
    for name, vpp in (("pp2", None), ("pp2_vpp2", 2)):
        init_model_parallel(Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp), seed=0)
        model, spec = build_and_load(hf_dir, dtype=torch.float32)
        trainable = make_trainable(model, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0), total_steps=10)
        assert len(trainable.chunks) == (vpp or 1)
        micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(N)]
        settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
        denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
        metrics = train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
        after = token_logprobs(trainable.chunks, batch["input_ids"], micro_batch_size=1)
        weights = export_to_dict(trainable.chunks, spec)
        out[name] = {"metrics": metrics, "after": after, "weights": weights if dist.get_rank() == 0 else None}
    return out


@pytest.mark.parity_repeat  # the AVX2 tier keeps the logprob parity above (the same chunks and kernels)
def test_train_step_pp2_vpp2_equals_pp2(tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl import algo
    from tests.dist.test_actor_step import CLIP_HIGH, CLIP_LOW, _batch

    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")  # tied embeddings: the head's gradient crosses ranks
    batch = _batch(hf_dir)
    results = run_ranks(f"{__name__}:vpp_step_rank", 2, {"hf_dir": str(hf_dir), "batch": batch}, timeout=600)

    # the PP2 run against plain torch on the HF model (independent of megatron): the loss
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    logits = model(input_ids=batch["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    ref_loss, _ = algo.ppo_clip_loss(batch["old_log_probs"], lp, batch["advantages"], batch["response_mask"],
                                     "token-mean", CLIP_LOW, CLIP_HIGH, 3.0)

    for r in results:
        base, vpp = r["pp2"]["metrics"], r["pp2_vpp2"]["metrics"]
        assert abs(base["pg_loss"] - ref_loss.item()) < 1e-5, (base["pg_loss"], ref_loss.item())
        print(f"[pp2 vs pp2 x vpp2] pg_loss {base['pg_loss']:.8f} vs {vpp['pg_loss']:.8f} (torch "
              f"{ref_loss.item():.8f}), grad_norm {base['grad_norm']:.8f} vs {vpp['grad_norm']:.8f}")
        # both layouts run the same GEMM shapes and reduction order on each rank (one layer per chunk either way):
        # equal up to a few ulp, so these comparisons (and the weights after Adam at eps 1e-8) are tight on purpose
        for key in ("pg_loss", "grad_norm", "pg_clipfrac"):
            assert abs(base[key] - vpp[key]) <= 1e-6 * max(1.0, abs(base[key])), (key, base[key], vpp[key])
    last = [r for r in results if r["pp2"]["after"] is not None]
    assert len(last) == 1 and last[0]["pp2_vpp2"]["after"] is not None
    mask = batch["input_ids"][:, 1:] != 0
    diff = (last[0]["pp2"]["after"] - last[0]["pp2_vpp2"]["after"]).abs()[mask].max().item()
    print(f"[pp2 vs pp2 x vpp2] max |logprob diff| after the update = {diff:.2e}")
    assert diff < 1e-6, diff
    base_w, vpp_w = results[0]["pp2"]["weights"], results[0]["pp2_vpp2"]["weights"]
    assert set(base_w) == set(vpp_w)
    worst = max((base_w[k] - vpp_w[k]).abs().max().item() for k in base_w)
    print(f"[pp2 vs pp2 x vpp2] max |weight diff| after the update = {worst:.2e}")
    assert worst < 1e-6, worst


@pytest.mark.parity_repeat
def test_checkpoint_saved_at_pp2_vpp2_merges_to_hf(tmp_path):
    """A PP2 x VPP2 checkpoint (megatron's per-chunk `model0`/`model1` state, global layer keys) of a trained actor and
    critic merges into HF directories whose transformers logprobs / values equal the saving megatron model's."""
    from tests.dist.test_merge import _batch as merge_batch, _check_merged

    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")
    batch = merge_batch(hf_dir)
    run_dir = tmp_path / "run"
    results = run_ranks("tests.dist.test_merge:save_rank", 2,
                        {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch, "tp": 1, "pp": 2, "ep": 1,
                         "critic": True, "vpp": 2}, timeout=600)
    meta = (run_dir / "checkpoints" / "step_1" / "meta.json").read_text()
    assert '"virtual_pipeline_model_parallel_size": 2' in meta
    last = [r for r in results if r["logprobs"] is not None]
    _check_merged(tmp_path, (hf_dir, batch, run_dir, last), "pp2_vpp2")


@pytest.mark.slow
def test_checkpoint_saved_at_pp2_vpp2_resumes_at_pp2(tmp_path):
    """Save at PP2 x VPP2 after one step (micro-batches of 2: a count of 2 = PP); resume at PP2 without virtual
    stages: the same model and the same Adam state (the next step lands on the same weights)."""
    from tests.dist.test_checkpoint_reshard import _bounds, _last_stage, _max_diff

    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")
    tokens, lengths = sample_tokens(4, 20, seed=3, min_len=12)
    mask = torch.zeros(4, 19, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, 5: length - 1] = True
    batch = {"input_ids": tokens, "response_mask": mask, "old_log_probs": hf_logprobs(hf_dir, tokens),
             "advantages": torch.randn(4, 19, generator=torch.Generator().manual_seed(5))}
    common = {"hf_dir": str(hf_dir), "run_dir": tmp_path / "run", "batch": batch, "tp": 1, "pp": 2,
              "micro_batch_size": 2}
    ref = _last_stage(run_ranks("tests.dist.test_checkpoint_reshard:ckpt_rank", 2,
                                {**common, "mode": "save", "vpp": 2}, timeout=600))
    got = _last_stage(run_ranks("tests.dist.test_checkpoint_reshard:ckpt_rank", 2,
                                {**common, "mode": "load"}, timeout=600))
    assert got["resumed_step"] == 1 and got["steps"] == 1
    moved = _max_diff(ref["after_next_step"], ref["at_checkpoint"], batch)
    tol, tol_after = _bounds(hf_dir, batch, ref, moved)  # the saving run's Adam has eps ADAM_EPS: lr / eps = 1
    assert moved > 10 * tol_after, (moved, tol_after)
    same = _max_diff(got["at_checkpoint"], ref["at_checkpoint"], batch)
    after = _max_diff(got["after_next_step"], ref["after_next_step"], batch)
    print(f"[pp2 x vpp2 -> pp2] resumed logprobs diff {same:.2e} (bound {tol:.2e}), after the next step {after:.2e} "
          f"(bound {tol_after:.2e}, moved {moved:.2e})")
    assert same < tol and after < tol_after, (same, tol, after, tol_after)


@pytest.mark.slow
def test_weight_sync_from_pp2_vpp2_after_update(tmp_path):
    """The trainer's per-rank weight sync from PP2 x VPP2 chunks into a vLLM engine, before and after one update: the
    engine's logprobs of its samples equal the updated actor's (the derived float32 bound) and the bytes moved equal
    the plan's."""
    from tests.dist.test_sync_after_update import sampled_bound

    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    results = run_ranks("tests.dist.test_sync_after_update:update_then_sync", 2,
                        {"hf_dir": str(hf_dir), "tp": 1, "pp": 2, "ep": 1, "engine_tp": 1, "prepacks": [True],
                         "vpp": 2}, timeout=600)
    per_rank = [r[0] for r in results]
    diffs = [r["diff"] for r in per_rank if r["diff"] is not None]
    tol = sampled_bound(hf_dir, per_rank[0])
    print(f"[pp2 x vpp2 sync] max |engine - actor logprob| = {max(diffs):.2e} (bound {tol:.2e})")
    assert diffs and max(diffs) < tol, (diffs, tol)
    sync = per_rank[0]["sync"]
    assert sync["weight_sync/verified_tensors"] > 0
    for kind in ("sent", "received", "loaded"):
        assert sync[f"weight_sync/{kind}_bytes_max"] == sync[f"weight_sync/plan_{kind}_bytes_max"], sync
