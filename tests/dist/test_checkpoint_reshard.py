"""A checkpoint saved at TP2 resumes at another layout: the same model (equal logprobs) and the same optimizer state
(the next Adam step lands on the same weights as at the saving layout).

The saving run takes one PPO step (so Adam's moments are not zero), saves through megarl's Checkpointer, records the
logprobs, takes a second step on the same batch and records the logprobs again. The loading run (TP1, or PP2) resumes
with the Checkpointer, must reproduce the first logprobs, and after its own second step the second ones. Adam's second
step depends on the moments of the first, so a lost or misplaced optimizer state shows up as a different second step
(checked: a load without the optimizer state does differ).
The layouts round differently: the resumed model's logprobs are compared within the derived float32 bound, and the
steps run Adam with eps = tests.helpers.bounds.ADAM_EPS (lr / eps = 1) so that the logprobs after the next step have a
derived bound too (tests/helpers/bounds.py).
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import ADAM_EPS, after_step_bound, forward_with_weights
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
LR, N, S = 1e-3, 4, 20


def _config(run_dir, tp, pp, world, load_optimizer=True, vpp=None):
    from megarl.config import MegarlConfig

    return MegarlConfig.model_validate({
        "trainer": {"run_dir": str(run_dir), "n_gpus_per_node": world, "total_steps": 10},
        "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                        "virtual_pipeline_model_parallel_size": vpp},
        "checkpoint": {"load_optimizer": load_optimizer, "save_on_sigterm": False}})


def ckpt_rank(hf_dir, run_dir, batch, tp, pp, mode, load_optimizer=True, vpp=None, micro_batch_size=None):
    import torch.distributed as dist

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
                               virtual_pipeline_model_parallel_size=vpp), seed=0)
    model, spec = build_and_load(hf_dir)
    trainable = make_trainable(model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0, clip_grad=0.0),
                               total_steps=10)
    cfg = _config(run_dir, tp, pp, dist.get_world_size(), load_optimizer, vpp)
    rt = Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=0, dp_size=1, run_dir=run_dir)
    ckpt = Checkpointer(cfg, rt, models={"actor": trainable}, states={})
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)

    mbs = micro_batch_size or N  # virtual pipeline stages need a micro-batch count that is a multiple of PP
    micro = [{k: v[i:i + mbs] for k, v in batch.items()} for i in range(0, N, mbs)]

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
    train_step()
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
