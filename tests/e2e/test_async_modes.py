"""trainer.mode=async on the tiny recipe, end to end (real engine process, real megatron, real weight syncs):
the staleness of every step follows the schedule and never exceeds async_training.max_staleness; the engine really
samples with older weights (its logprobs differ from the actor's exactly on the stale steps); rollout correction sees
them; and a run SIGKILLed in the middle of a save resumes exactly, with generations in flight at the save."""
import json
from pathlib import Path

import pytest

from megarl.checkpoint.locate import complete_checkpoints
from megarl.launch_local import RankFailure, run_ranks
from megarl.validate import load_config
from tests.e2e.test_checkpoint_resume import _assert_same_steps
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE, SMALL

STEPS = 6
ASYNC = ["trainer.mode=async", "async_training.max_staleness=2", "algorithm.rollout_correction.is_level=token"]


def _run(tmp: Path, name: str, extra=(), env=None) -> list[dict]:
    run_dir = tmp / name
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(RECIPE, SMALL + [f"trainer.run_dir={run_dir}", f"model.path={tmp / 'model'}",
                                       f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}",
                                       f"trainer.total_steps={STEPS}", *ASYNC, *extra])
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=900, env=env,
              log_dir=str(run_dir / "logs"))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return tmp, _run(tmp, "straight")


def test_staleness_follows_the_schedule_and_the_engine_samples_with_older_weights(straight):
    _, metrics = straight
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # two batches generated ahead with the weights of the last sync; the sync comes when none is in flight
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 2, 1, 2, 1]
    assert [m["async/sample_version"] for m in metrics] == [0, 0, 0, 2, 2, 4]
    assert all(m["async/dropped_samples"] == 0 for m in metrics)
    for m in metrics:
        stale = m["async/staleness_max"] > 0
        assert m["async/off_policy_token_frac"] == (1.0 if stale else 0.0)
        # the engine's logprobs are the actor's on the weights it holds: equal when fresh, apart when stale
        assert (m["rollout/logprob_abs_diff_mean"] > 1e-3) if stale else (m["rollout/logprob_abs_diff_mean"] < 1e-4), m
        assert "rollout_correction/is_weight_mean" in m  # the stale tokens are reweighted
        assert (m["mismatch_k3_kl"] > 1e-4) if stale else (m["mismatch_k3_kl"] < 1e-6), m
    assert metrics[0]["actor/log_ratio_abs_max"] < 1e-6  # step 1 is on-policy
    assert metrics[-1]["actor/grad_norm"] > 0


@pytest.mark.slow
def test_sigkill_in_a_save_then_resume_is_exact(straight):
    """Saving every step awaits the generations in flight; SIGKILL while step 4 is saved; the resume from step 3's
    checkpoint (buffer: step 4's and 5's batches, generated with version 2) logs steps 4-6 equal to the run that
    never saved."""
    tmp, ref = straight
    save = ["checkpoint.save_freq=1", "checkpoint.keep_last_k=2"]
    with pytest.raises(RankFailure, match="exited with -9"):
        _run(tmp, "killed", save, env={"MEGARL_TEST_SIGKILL_IN_SAVE": "4"})
    root = tmp / "killed" / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [2, 3]
    state = json.loads((root / "step_3" / "trainer_state.json").read_text())["schedule"]
    assert [(b["step"], b["version"]) for b in state["buffer"]] == [(4, 2), (5, 2)]
    got = _run(tmp, "killed", save)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    _assert_same_steps(got, ref, range(1, STEPS + 1))


def test_continue_generate_resumes_aborted_samples_on_the_real_engine(tmp_path):
    """async_training.partial_rollout=abort_resume's engine side: samples an abort cut short continue from prompt +
    partial response for exactly the budget left, and the continuation's rollout logprobs are the engine's own
    logprobs of those tokens after that prefix (checked against a teacher-forced pass over the whole sequence)."""
    from megarl.rollout.vllm.engine import VLLMEngine
    from tests.e2e.test_engine_requests import LONG, PROMPTS, config
    from tests.helpers.engine_abort import generate_aborted_at_step
    from tests.helpers.tiny_models import make_tiny_model

    engine = VLLMEngine(config(), str(make_tiny_model("qwen2", tmp_path / "qwen2")), seed=0, device="cpu")
    try:
        partial = generate_aborted_at_step(engine, 20, PROMPTS, seed=11)
        rows = list(range(len(partial)))
        assert partial.finish_reasons == ["abort"] * len(rows)
        cont = engine.continue_generate([partial.prompt_ids[i] for i in rows], [partial.response(i) for i in rows],
                                        partial.prompt_index.tolist(), [500 + i for i in rows])
        assert cont.finish_reasons == ["length"] * len(rows)
        assert cont.prompt_index.tolist() == partial.prompt_index.tolist()
        for i in rows:
            assert len(partial.response(i)) + len(cont.response(i)) == LONG  # the budget left, no more
        whole = [partial.prompt_ids[i] + partial.response(i) + cont.response(i) for i in rows]
        forced = engine.sequence_logprobs(whole)
        for i in rows:
            start = len(partial.prompt_ids[i]) + len(partial.response(i)) - 1  # position t scores token t+1
            assert cont.logprobs(i) == pytest.approx(forced[i][start:], abs=1e-4)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_abort_resume_loop_keeps_the_engine_current_and_every_response_whole(tmp_path):
    """The whole loop with partial_rollout=abort_resume and responses long enough (ignore_eos) that a generation is
    usually still running when the next step's batch is taken: the engines sync every step, every response still
    gets exactly its full length (the continuation takes the budget the abort left), staleness stays within 2."""
    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    metrics = _run(tmp_path, "abort", ["async_training.partial_rollout=abort_resume", "rollout.response_length=96",
                                       "rollout.ignore_eos=true", "trainer.total_steps=5"])
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        assert m["async/engine_version"] == m["step"] - 1  # synced at every step, whatever was in flight
        assert m["train/response_length_mean"] == 96 and m["rollout/num_aborted"] == 0
        assert m["async/staleness_max"] <= 2
    print("resumed samples per step:", [m.get("async/resumed_samples", 0) for m in metrics])


@pytest.mark.slow
def test_async_with_the_engine_placed_separately(straight):
    """trainer.mode=async with rollout.placement=separate (the engine in a process of its own, weights over the
    transfer group): the same staleness per step as the colocated run, the engine samples with the weights it holds
    (its logprobs equal the actor's on fresh steps only), and every sync moves exactly the planned bytes."""
    tmp, ref = straight
    got = _run(tmp, "separate", ["rollout.placement=separate"])
    assert [m["async/staleness_max"] for m in got] == [m["async/staleness_max"] for m in ref] == [0, 1, 2, 1, 2, 1]
    for m in got:
        stale = m["async/staleness_max"] > 0
        assert (m["rollout/logprob_abs_diff_mean"] > 1e-3) if stale else (m["rollout/logprob_abs_diff_mean"] < 1e-4), m
        if "weight_sync/received_bytes_max" in m:
            for kind in ("sent", "received", "loaded"):
                assert m[f"weight_sync/{kind}_bytes_max"] == m[f"weight_sync/plan_{kind}_bytes_max"] > 0, m
