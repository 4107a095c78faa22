"""A checkpoint saved at TP2 (or at CP2) resumes at another layout: the same model (equal logprobs) and the same optimizer state
(the next Adam step lands on the same weights as at the saving layout).

The saving run takes one PPO step (so Adam's moments are not zero), saves through megarl's Checkpointer, records the
logprobs, takes a second step on the same batch and records the logprobs again. The loading run (TP1, or PP2) resumes
with the Checkpointer, must reproduce the first logprobs, and after its own second step the second ones. Adam's second
step depends on the moments of the first, so a lost or misplaced optimizer state shows up as a different second step
(checked: a load without the optimizer state does differ).
The layouts round differently: the resumed model's logprobs are compared within the derived float32 bound, and the
steps run Adam with eps = tests.helpers.bounds.ADAM_EPS (lr / eps = 1) so that the logprobs after the next step have a
derived bound too (tests/helpers/bounds.py).

A checkpoint saved at context parallelism 2 (weights and Adam moments replicated over the CP ranks, as over DP) resumes
at DP2, where each DP rank trains on its half of the rows and the gradients are averaged over DP, and at CP1 x TP2: the
same logprobs, the same next-step loss (bound derived in _loss_bound) and the same weights after that step.
"""
import math

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import ADAM_EPS, after_step_bound, forward_with_weights
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
LR, N, S = 1e-3, 4, 20


def _config(run_dir, tp, pp, world, load_optimizer=True, vpp=None, cp=1):
    from megarl.config import MegarlConfig

    return MegarlConfig.model_validate({
        "trainer": {"run_dir": str(run_dir), "n_gpus_per_node": world, "total_steps": 10},
        "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                        "virtual_pipeline_model_parallel_size": vpp, "context_parallel_size": cp},
        "checkpoint": {"load_optimizer": load_optimizer, "save_on_sigterm": False}})


def ckpt_rank(hf_dir, run_dir, batch, tp, pp, mode, load_optimizer=True, vpp=None, micro_batch_size=None, cp=1):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.bridge.exporter import export_to_dict
    from megarl.checkpoint.state import Checkpointer
    from megarl.config.schema import OptimConfig
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from megarl.runtime import Runtime

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp), seed=0)
    model, spec = build_and_load(hf_dir)
    trainable = make_trainable(model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0, clip_grad=0.0),
                               total_steps=10)
    cfg = _config(run_dir, tp, pp, dist.get_world_size(), load_optimizer, vpp, cp)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rt = Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=dp_rank, dp_size=dp, run_dir=run_dir)
    ckpt = Checkpointer(cfg, rt, models={"actor": trainable}, states={})
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)

    # each DP rank trains on its share of the rows (the denominator and the gradients are summed over DP)
    rows = N // dp
    mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}
    mbs = min(micro_batch_size or N, rows)  # virtual pipeline stages need a micro-batch count that is a multiple of PP
    micro = [{k: v[i:i + mbs] for k, v in mine.items()} for i in range(0, rows, mbs)]

    def train_step():
        denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
        return train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))

    def logprobs():
        return token_logprobs(trainable.chunks, batch["input_ids"], micro_batch_size=N)

    out = {}
    if mode == "save":
        train_step()
        ckpt.save(1)
    else:
        out["resumed_step"] = ckpt.resume()
        out["steps"] = trainable.steps
        out["scheduler_steps"] = trainable.scheduler.num_steps
    out["at_checkpoint"] = logprobs()
    out["weights"] = export_to_dict(trainable.chunks, spec) if mode == "save" else None  # the saved model, HF names
    out["next_step"] = train_step()  # its loss: the resumed model's, summed over micro-batches and DP
    out["after_next_step"] = logprobs()
    return out


def _last_stage(results):
    return next(r for r in results if r["at_checkpoint"] is not None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    hf_dir = make_tiny_model("qwen2", tmp / "qwen2")  # tied embeddings, QKV bias
    tokens, lengths = sample_tokens(N, S, seed=3, min_len=12)
    mask = torch.zeros(N, S - 1, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, 5: length - 1] = True
    adv = torch.randn(N, S - 1, generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": tokens, "response_mask": mask, "old_log_probs": hf_logprobs(hf_dir, tokens),
             "advantages": adv}
    run_dir = tmp / "run"
    results = run_ranks(f"{__name__}:ckpt_rank", 2, {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch,
                                                     "tp": 2, "pp": 1, "mode": "save"}, timeout=300)
    return hf_dir, run_dir, batch, _last_stage(results)


def _max_diff(a, b, batch):
    mask = batch["input_ids"][:, 1:] != 0
    return (a - b).abs()[mask].max().item()


# the AVX2 tier leaves it out (parity_repeat): the actor-step tests there run the same update kernels
@pytest.mark.parametrize("tp,pp", [pytest.param(1, 1, marks=pytest.mark.parity_repeat),
                                   pytest.param(1, 2, marks=pytest.mark.slow)], ids=["tp1", "pp2"])
def test_tp2_checkpoint_resumes_at_another_layout(saved, tp, pp):
    hf_dir, run_dir, batch, ref = saved
    assert (run_dir / "checkpoints" / "step_1" / "meta.json").exists()
    got = _last_stage(run_ranks(f"{__name__}:ckpt_rank", tp * pp,
                                {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch, "tp": tp, "pp": pp,
                                 "mode": "load"}, timeout=300))
    assert got["resumed_step"] == 1 and got["steps"] == 1 and got["scheduler_steps"] == 1
    moved = _max_diff(ref["after_next_step"], ref["at_checkpoint"], batch)
    tol, tol_after = _bounds(hf_dir, batch, ref, moved)
    assert moved > 10 * tol_after, (moved, tol_after)  # the second step moves logprobs far beyond rounding
    same = _max_diff(got["at_checkpoint"], ref["at_checkpoint"], batch)
    after = _max_diff(got["after_next_step"], ref["after_next_step"], batch)
    print(f"[measured] resumed {same:.2e} (bound {tol:.2e}), after the next step {after:.2e} (bound {tol_after:.2e}, "
          f"moved {moved:.2e})")
    assert same < tol, (same, tol)  # same model
    assert after < tol_after, (after, tol_after)  # same Adam state


def _bounds(hf_dir, batch, ref, moved):
    """The derived bounds on the saved model's logprobs at another layout, and after the next step that moved them by
    `moved` (tests/helpers/bounds.py)."""
    mask = batch["input_ids"][:, 1:] != 0
    _, tol = forward_with_weights(hf_dir, ref["weights"], batch["input_ids"], mask)
    return tol, after_step_bound(hf_dir, batch["input_ids"], mask, moved, LR, before=tol)


@pytest.fixture(scope="module")
def saved_cp2(saved, tmp_path_factory):
    """The same model, batch and first step, saved at CP2 (2 ranks: each holds chunks r and 3 - r of every row)."""
    hf_dir, _, batch, _ = saved
    run_dir = tmp_path_factory.mktemp("reshard_cp2") / "run"
    results = run_ranks(f"{__name__}:ckpt_rank", 2, {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch,
                                                     "tp": 1, "pp": 1, "cp": 2, "mode": "save"}, timeout=300)
    return hf_dir, run_dir, batch, _last_stage(results)


def _loss_bound(batch, ref, tol):
    """Bound on the next step's loss of the same model at two layouts whose logprobs differ by at most `tol`.

    The loss is a token-mean of f(r) = -A * clip-and-min(ratio) (PolicyLossSettings' defaults: clip 0.2 / 0.2, dual
    clip c = 3), ratio r = exp(lp - old). Per token f is |A|-Lipschitz in r and constant once r passes
    R = max(1 + clip_high, c) (A > 0: above 1 + clip_high; A < 0: above the dual clip c), so f(r) = g(min(r, R)) and
    two ratios r and r e^d, |d| <= tol, give |df| <= |A| * min(r_max, R) * expm1(tol), with r_max the saver's largest
    ratio on the batch widened by e^tol. The token-mean of N terms, summed in another order, adds at most 2 N u of
    the largest term (u = 2^-24)."""
    from megarl.megatron.losses import PolicyLossSettings

    s = PolicyLossSettings(vocab_size=1)
    mask = batch["response_mask"]
    a_max = float(batch["advantages"][mask].abs().max())
    r_max = math.exp(float((ref["at_checkpoint"] - batch["old_log_probs"])[mask].max()) + tol)
    r_eff = min(r_max, max(1 + s.clip_ratio_high, s.clip_ratio_c))
    return a_max * r_eff * (math.expm1(tol) + 2 * int(mask.sum()) * 2.0 ** -24)


@pytest.mark.slow  # three 2-rank launches (save, and two loads)
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1)], ids=["dp2", "tp2"])
def test_cp2_checkpoint_resumes_at_dp2_and_at_tp2(saved_cp2, tp, cp):
    """Saved at CP2 (DP1), resumed on 2 ranks at DP2 (CP1 TP1: the 4 rows split 2 and 2 over the DP ranks) and at
    CP1 TP2: equal logprobs at the checkpoint, equal next-step loss, equal logprobs after that step."""
    hf_dir, run_dir, batch, ref = saved_cp2
    assert (run_dir / "checkpoints" / "step_1" / "meta.json").exists()
    got = _last_stage(run_ranks(f"{__name__}:ckpt_rank", 2,
                                {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch, "tp": tp, "pp": 1,
                                 "cp": cp, "mode": "load"}, timeout=300))
    assert got["resumed_step"] == 1 and got["steps"] == 1 and got["scheduler_steps"] == 1
    moved = _max_diff(ref["after_next_step"], ref["at_checkpoint"], batch)
    tol, tol_after = _bounds(hf_dir, batch, ref, moved)
    assert moved > 10 * tol_after, (moved, tol_after)
    same = _max_diff(got["at_checkpoint"], ref["at_checkpoint"], batch)
    loss_a, loss_b = ref["next_step"]["pg_loss"], got["next_step"]["pg_loss"]
    loss_tol = _loss_bound(batch, ref, tol)
    after = _max_diff(got["after_next_step"], ref["after_next_step"], batch)
    print(f"[measured] CP2 -> {'DP2' if tp == 1 else 'TP2'}: resumed {same:.2e} (bound {tol:.2e}), next-step loss "
          f"{abs(loss_a - loss_b):.2e} (bound {loss_tol:.2e}, loss {loss_a:.4f}), after it {after:.2e} (bound "
          f"{tol_after:.2e}, moved {moved:.2e})")
    assert abs(loss_a) > 10 * loss_tol, (loss_a, loss_tol)  # a non-trivial loss, not 0 == 0
    assert same < tol, (same, tol)  # same model
    assert abs(loss_a - loss_b) <= loss_tol, (loss_a, loss_b, loss_tol)  # the same next-step loss
    assert after < tol_after, (after, tol_after)  # same Adam state, and DP2's averaged gradient is the whole batch's


@pytest.mark.slow
def test_resume_without_optimizer_state_takes_a_different_step(saved):
    """The check above is sensitive: fresh Adam moments give a visibly different second step."""
    hf_dir, run_dir, batch, ref = saved
    got = _last_stage(run_ranks(f"{__name__}:ckpt_rank", 1,
                                {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch, "tp": 1, "pp": 1,
                                 "mode": "load", "load_optimizer": False}, timeout=300))
    tol, tol_after = _bounds(hf_dir, batch, ref, _max_diff(ref["after_next_step"], ref["at_checkpoint"], batch))
    assert _max_diff(got["at_checkpoint"], ref["at_checkpoint"], batch) < tol
    differs = _max_diff(got["after_next_step"], ref["after_next_step"], batch)
    print(f"[measured] without the optimizer state the next step differs by {differs:.2e} (bound {tol_after:.2e})")
    assert differs > 10 * tol_after, (differs, tol_after)  # checkpoint.load_optimizer=false
