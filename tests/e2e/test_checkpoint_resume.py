"""Checkpoint/resume of the whole RL loop loses nothing: a run stopped and resumed logs the same metrics as a run that
never stopped, and a crash in the middle of a save leaves the previous checkpoint resumable.

Each variant is a list of config overrides on the small GRPO settings of test_grpo_loop; a variant with a critic
(PPO with GAE) only needs its overrides added to VARIANTS.
"""
import json
import os
from pathlib import Path

import pytest

from megarl.checkpoint.locate import complete_checkpoints, latest_checkpoint, read_meta
from megarl.launch_local import RankFailure, run_ranks
from megarl.validate import load_config
from tests.e2e.test_grpo_loop import PARITY_REWARD, RECIPE, SMALL

STEPS = 6
VARIANTS = {"grpo": [], "ppo": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.use_kl_in_reward=true",
                                  "algorithm.kl_ctrl.type=adaptive", "critic.ppo_micro_batch_size_per_gpu=8",
                                  "ref.log_prob_micro_batch_size_per_gpu=8"],
            # LoRA: the checkpoint holds the frozen base, the adapters and their Adam moments; the reference of the KL
            # loss is the actor with adapters disabled
            "lora": ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=all-linear",
                     "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "ref.log_prob_micro_batch_size_per_gpu=8"]}
# adapter sync: the resumed engine starts on the base and gets the checkpoint's adapters before its first rollout
VARIANTS["lora_adapter"] = VARIANTS["lora"] + ["actor.lora.sync=adapter"]
# metrics that measure time, or count the engine's weight loads since it started: they differ between any two runs
VOLATILE = ("timing/", "seconds", "per_second", "gbps", "weight_sync/version")
OWNER = "MEGARL_TEST_RESUME_OWNER"


def _run(tmp: Path, name: str, variant: str, extra=(), env=None) -> list[dict]:
    run_dir = tmp / name
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    cfg = load_config(RECIPE, SMALL + [f"trainer.run_dir={run_dir}", f"model.path={tmp / 'model'}",
                                       f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}",
                                       f"trainer.total_steps={STEPS}", *VARIANTS[variant], *extra])
    env = {**(env or {}), OWNER: str(os.getpid())}  # marks every process the run starts (see the orphan test)
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=600, env=env,
              log_dir=str(run_dir / "logs"))
    return _metrics(run_dir)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(got: list[dict], ref: list[dict], steps) -> None:
    by_step = {m["step"]: m for m in got}
    for want in (m for m in ref if m["step"] in steps):
        have = by_step[want["step"]]
        keys = {k for k in want if not any(v in k for v in VOLATILE)}
        # every metric of the reference is there after a resume (extra keys are tolerated: a metric added to the code
        # between the reference run and this one, as happens while several people edit the tree)
        assert keys <= set(have), (want["step"], sorted(keys - set(have)))
        for k in sorted(keys):
            a, b = want[k], have[k]
            assert (a is None and b is None) or abs(a - b) <= 1e-6 * max(1.0, abs(a)), (want["step"], k, a, b)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


# PPO (critic, reference, adaptive KL state) in `make test-slow`: the same resume path as GRPO plus the critic's state
@pytest.fixture(scope="module", params=["grpo", pytest.param("ppo", marks=pytest.mark.slow),
                                        pytest.param("lora", marks=pytest.mark.slow),
                                        pytest.param("lora_adapter", marks=pytest.mark.slow)])
def straight(request, tmp):
    """STEPS steps without stopping (one checkpoint, at the end)."""
    variant = request.param
    metrics = _run(tmp, f"{variant}-straight", variant)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert 0 < metrics[-1]["train/reward_mean"] < 1 and metrics[-1]["actor/grad_norm"] > 0  # the model really trains
    assert [s for s, _ in complete_checkpoints(tmp / f"{variant}-straight" / "checkpoints")] == [STEPS]
    return variant, metrics


def test_sigkill_in_the_middle_of_a_save_then_resume_is_exact(straight, tmp):
    """SIGKILL while step 4's checkpoint is being written: step 3's stays resumable, and resuming from it gives
    steps 4-6 equal to the uninterrupted run (data position, weights, Adam moments, LR schedule, sampling seeds)."""
    variant, ref = straight
    name, save = f"{variant}-killed", ["checkpoint.save_freq=1", "checkpoint.keep_last_k=2"]
    run_dir = tmp / name
    with pytest.raises(RankFailure, match="exited with -9"):
        _run(tmp, name, variant, save, env={"MEGARL_TEST_SIGKILL_IN_SAVE": "4"})
    root = run_dir / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [2, 3]  # keep_last_k=2 removed step 1
    assert (root / "step_4.tmp" / "actor").is_dir() and not (root / "step_4").exists()  # half written, set aside
    assert read_meta(root / "step_4.tmp") is None
    assert latest_checkpoint(root) == root / "step_3"
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4]  # step 4 was logged before the crash

    got = _run(tmp, name, variant, save)  # checkpoint.resume=auto
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # the crashed run's step 4 was replaced, not repeated
    _assert_same_steps(got, ref, range(1, STEPS + 1))
    assert [s for s, _ in complete_checkpoints(root)] == [5, 6] and not (root / "step_4.tmp").exists()
    assert "resumed from" in (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_sigterm_saves_stops_and_resume_is_exact(straight, tmp):
    """A SIGTERM (preemption) during step 3: the run finishes the step, saves, exits cleanly; resuming is exact."""
    variant, ref = straight
    name = f"{variant}-sigterm"
    first = _run(tmp, name, variant, env={"MEGARL_TEST_SIGTERM_AT_STEP": "3"})
    assert [m["step"] for m in first] == [1, 2, 3]
    root = tmp / name / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [3]
    state = json.loads((root / "step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["loader"]["batches_returned"] == 3
    got = _run(tmp, name, variant)
    _assert_same_steps(got, ref, range(1, STEPS + 1))
    assert [s for s, _ in complete_checkpoints(root)] == [3, STEPS]


def test_no_process_of_the_runs_outlives_them():
    """Every process the runs above started has exited, the SIGKILLed rank's children included (the vLLM engine child
    notices its parent is gone; dist_checkpointing's writer Manager must not linger either)."""
    import time

    if not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    marker = f"{OWNER}={os.getpid()}".encode()
    deadline = time.monotonic() + 30
    while True:
        left = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "environ").read_bytes():
                        left.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                except OSError:
                    continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, left
