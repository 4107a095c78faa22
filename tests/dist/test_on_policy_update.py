"""The actor update without a separate old-logprob pass equals the update with it, and plain torch's.

When a step's batch gets exactly one optimizer step, the trainer skips the old-logprob forward: the update's own
forward, detached, serves as the old logprobs (PPO ratio exactly 1) and comes back in batch["old_log_probs"] for the
metrics. Both paths run on the same batch in one process and are compared with each other and with an independent
reference: HF transformers logprobs, megarl.algo's PPO loss with old = the detached logprobs, torch.optim.Adam.
Adam runs with eps = tests.helpers.bounds.ADAM_EPS so that the logprobs after the step have a derived bound.
The layouts exercise how the returned logprobs are put back together: rows shuffled over two DP ranks and packed by
token budget (columns cut per micro-batch), and a PP2 pipeline whose last stage alone computes them.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import ADAM_EPS, after_step_bound, logprob_bound
from tests.helpers.tiny_models import make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity

LR, N, S, GROUP = 1e-3, 8, 20, 2


def _config(dp: int, tp: int, pp: int, dynamic_bsz: bool):
    from megarl.config import MegarlConfig

    return MegarlConfig.model_validate({
        "trainer": {"n_gpus_per_node": dp * tp * pp, "total_steps": 10, "seed": 4},
        "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        "data": {"train_batch_size": N // GROUP},
        "rollout": {"n": GROUP, "log_prob_micro_batch_size_per_gpu": 2},
        "actor": {"ppo_mini_batch_size": N // GROUP, "ppo_micro_batch_size_per_gpu": 2, "shuffle": True,
                  "use_dynamic_bsz": dynamic_bsz, "ppo_max_token_len_per_gpu": 40, "clip_ratio": 0.2,
                  "optim": {"lr": LR, "eps": ADAM_EPS, "weight_decay": 0.0, "clip_grad": 0.0}}})


def update_rank(hf_dir, batch, dp, tp, pp, dynamic_bsz):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.workers import PolicyWorker
    from megarl.runtime import Runtime

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    cfg = _config(dp, tp, pp, dynamic_bsz)
    rt = Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=ps.get_data_parallel_rank(),
                 dp_size=ps.get_data_parallel_world_size(), run_dir=None)
    out = {}
    for mode in ("separate", "on_policy"):
        actor = PolicyWorker(hf_dir, cfg, trainable=True)
        b = dict(batch)
        if mode == "separate":
            b["old_log_probs"] = actor.log_probs(b, rt)
            metrics = actor.update(b, rt, step=1)
        else:
            metrics = actor.update(b, rt, step=1, on_policy=True)
        out[mode] = {"metrics": metrics, "old": b["old_log_probs"], "after": actor.log_probs(b, rt)}
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megarl import algo

    hf_dir = make_tiny_model("llama", tmp_path_factory.mktemp("on_policy") / "llama")
    tokens, lengths = sample_tokens(N, S, seed=11, min_len=10)
    mask = torch.zeros(N, S - 1, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, 4: length - 1] = True  # "response" = tokens 5..length-1
    adv = torch.randn(N, S - 1, generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": tokens, "response_mask": mask, "advantages": adv}
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    logits = model(input_ids=tokens).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss, _ = algo.ppo_clip_loss(lp.detach(), lp, adv, mask, "token-mean", 0.2, 0.2, 3.0)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS).step()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
        after = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert abs(loss.item()) > 1e-3 and grad_norm > 1e-3  # a real update: the comparisons are not 0 == 0
    ref = {"old": lp.detach(), "loss": loss.item(), "grad_norm": grad_norm.item(), "after": after}
    moved = (after - lp.detach()).abs()[mask].max().item()
    ref["tol"] = logprob_bound(hf_dir, tokens, mask)
    ref["tol_after"] = after_step_bound(hf_dir, tokens, mask, moved, LR)
    assert moved > 10 * ref["tol_after"], (moved, ref["tol_after"])  # the step moves logprobs far beyond rounding
    return hf_dir, batch, ref


# the AVX2 tier keeps dp2-shuffle-dynamic-bsz (the case whose bound an AMX machine once broke)
@pytest.mark.parametrize("dp,tp,pp,dynamic_bsz", [(2, 1, 1, True),
                                                 pytest.param(1, 1, 2, False, marks=pytest.mark.parity_repeat)],
                         ids=["dp2-shuffle-dynamic-bsz", "pp2"])
def test_on_policy_update_equals_separate_pass_and_torch(setup, dp, tp, pp, dynamic_bsz):
    hf_dir, batch, ref = setup
    results = run_ranks(f"{__name__}:update_rank", dp * tp * pp,
                        {"hf_dir": str(hf_dir), "batch": batch, "dp": dp, "tp": tp, "pp": pp,
                         "dynamic_bsz": dynamic_bsz}, timeout=300)
    mask = batch["response_mask"]
    for r in results:  # every rank holds the whole batch's old logprobs, from either path
        sep, onp = r["separate"], r["on_policy"]
        assert onp["old"].shape == (N, S - 1)
        assert (onp["old"] - ref["old"]).abs()[mask].max().item() < ref["tol"]
        assert (onp["old"] - sep["old"]).abs()[mask].max().item() < ref["tol"]
        assert onp["metrics"]["actor/log_ratio_abs_max"] == 0.0  # ratio exactly 1 by construction
        assert onp["metrics"]["actor/pg_clipfrac"] == 0.0
        for path in (sep, onp):
            m = path["metrics"]
            assert abs(m["actor/pg_loss"] - ref["loss"]) < 1e-5, (m, ref["loss"])
            assert abs(m["actor/grad_norm"] - ref["grad_norm"]) < 1e-4 * max(1.0, ref["grad_norm"])
        assert abs(onp["metrics"]["actor/pg_loss"] - sep["metrics"]["actor/pg_loss"]) < 1e-6
        assert (onp["after"] - sep["after"]).abs()[mask].max().item() < ref["tol_after"]
        assert (onp["after"] - ref["after"]).abs()[mask].max().item() < ref["tol_after"]
