"""The RL loop on the tiny CPU recipe, run by `megarl train` as a user runs it: on-policy first step, a quiet console,
TP2 equals TP1, context parallelism composed with DP (and TP) equals CP1, and actionable errors for bad input."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.launch_local import run_ranks
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"
# small and fast: no SFT, 8 prompts x 4 samples, one mini-batch per step (so step 1 is entirely on-policy)
SMALL = ["sft.enable=false", "data.synthetic.num_train=64", "data.synthetic.num_val=8", "data.train_batch_size=8",
         "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
         "rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.total_steps=3", "trainer.test_freq=0",
         "trainer.val_before_train=false", "logging.tensorboard=false", "actor.optim.lr=1e-3"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A random model never answers an addition right: every reward would be 0, every advantage 0, and the weights would
# never move. This reward varies on any model, so the steps really update the actor and exercise the weight sync.
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str.split()) % 2)
"""


def _overrides(tmp: Path, name: str, extra=()) -> list[str]:
    reward = tmp / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    return SMALL + [f"trainer.run_dir={tmp / name}", f"model.path={tmp / 'model'}",
                    f"data.synthetic.output_dir={tmp / 'data'}", f"reward.reward_fn={reward}", *extra]


def _run(tmp: Path, name: str, extra=()) -> list[dict]:
    cfg = load_config(RECIPE, _overrides(tmp, name, extra))
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=600)
    return _metrics(tmp / name)


def _cli_run(tmp: Path, name: str, extra=()) -> tuple:
    """`megarl train` as a user runs it: (metrics, console lines, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "megarl", "train", str(RECIPE), *_overrides(tmp, name, extra)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _metrics(tmp / name), (proc.stdout + proc.stderr).splitlines(), proc.stderr


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    metrics, console, stderr = _cli_run(tmp, "tp1")
    return tmp, metrics, console, stderr


def test_first_step_is_on_policy(tp1):
    _, metrics, _, _ = tp1
    first = metrics[0]
    assert first["step"] == 1
    assert first["rollout/logprob_abs_diff_mean"] < 1e-4, first  # vLLM and megatron agree on the same weights
    assert first["actor/log_ratio_abs_max"] < 1e-6, first  # PPO ratio exactly 1 on the first mini-batch
    assert first["actor/clip_frac"] == 0.0
    assert 0.0 < first["train/reward_mean"] < 1.0  # rewards vary, so the advantages and the update are not zero
    assert metrics[1]["actor/log_ratio_abs_max"] > 0 or metrics[1]["actor/grad_norm"] > 0
    for m in metrics:  # after each weight sync the engine again samples from the actor's distribution
        assert m["rollout/logprob_abs_diff_mean"] < 1e-4, m


def test_metrics_jsonl_has_the_documented_keys(tp1):
    _, metrics, _, _ = tp1
    required = {"step", "train/reward_mean", "train/response_length_mean", "actor/pg_loss", "actor/kl",
                "actor/entropy", "actor/grad_norm", "actor/clip_frac", "timing/step_s", "timing/rollout_s",
                "timing/train_s", "timing/sync_s", "rollout/logprob_abs_diff_mean"}
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert required <= set(m), required - set(m)



def test_every_logged_metric_is_on_the_metrics_page(tp1):
    """What a real run writes, beside tests/unit/test_docs_metrics.py's reading of the code."""
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from test_docs_metrics import covered, documented

    _, metrics, _, _ = tp1
    docs = documented()
    logged = {k for m in metrics for k in m} - {"step"}
    missing = sorted(k for k in logged if not covered(k, docs))
    assert not missing, f"not in docs/metrics.md: {missing}"


@pytest.mark.slow  # a second 2-rank run (~36 s); TP2 = TP1 per update: tests/dist/test_actor_step, test_on_policy_update
def test_tp2_losses_equal_tp1(tp1):
    tmp, ref, _, _ = tp1
    got, _, _ = _cli_run(tmp, "tp2", ["parallelism.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"])
    assert any(abs(m["actor/pg_loss"]) > 1e-4 for m in ref[:2])  # equal non-trivial losses, not 0 == 0
    for a, b in zip(ref[:2], got[:2]):
        assert a["train/reward_mean"] == b["train/reward_mean"]  # same samples from the same seed and weights
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 1e-4, (a["actor/pg_loss"], b["actor/pg_loss"])
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 1e-4 * max(1, a["actor/grad_norm"])
    for m in got:  # two engine replicas (one per rank): each rank writes its worker's weights into its parameters
        assert m["weight_sync/placed_bytes"] == m["weight_sync/bytes"] > 0, m


def _first_step_bounds(tmp: Path, a: dict, b: dict, dp: int) -> tuple:
    """Derived bounds on the first step's pg_loss and grad_norm of one run computed at two layouts (a: DP1 CP1, b at
    data-parallel size dp): the same samples (checked by the caller), so the same advantages; only rounding differs.

    - Gradients: the same sums in another order (rows split over DP, tokens over CP, partial gradients all-reduced over
      DP x CP), relative error `rel` of the model's outputs, transposed (tests/helpers/bounds.relative_error over every
      parameter), plus what the ratios change in dL/dlp = -A * ratio / tokens: on the first mini-batch each run's
      ratio is exp(its own log ratio), at most exp(l) from 1 where l is the run's actor/log_ratio_abs_max (averaged
      over DP ranks, so at most dp times the metric): |d grad_norm| <= grad_norm * (rel + expm1(l_a + l_b)).
    - Loss: a token-mean of -A * ratio; GRPO's advantages (group-centred, over the group's unbiased std) are at most
      (n - 1) / sqrt(n) in size (Samuelson's inequality), and the mean of N tokens' products is summed in another
      order (at most 2 N u of its terms' magnitude, u = 2^-24): |d loss| <= A_max * (expm1(l_a + l_b) + 2 N u)."""
    from safetensors.torch import load_file

    from tests.helpers.bounds import relative_error

    cfg = load_config(RECIPE, _overrides(tmp, "bounds"))
    n_params = sum(t.numel() for f in (tmp / "model").glob("*.safetensors") for t in load_file(str(f)).values())
    rel = relative_error(tmp / "model", cfg.rollout.prompt_length + cfg.rollout.response_length, n_params)
    growth = math.expm1(a["actor/log_ratio_abs_max"] + dp * b["actor/log_ratio_abs_max"])
    n = cfg.rollout.n
    tokens = cfg.data.train_batch_size * n * cfg.rollout.response_length
    loss_tol = (n - 1) / math.sqrt(n) * (growth + 2 * tokens * 2.0 ** -24)
    return loss_tol, (rel + growth) * a["actor/grad_norm"]


def _assert_first_step_equal(tmp: Path, ref: list, got: list, dp: int, label: str) -> None:
    a, b = ref[0], got[0]
    assert a["train/reward_mean"] == b["train/reward_mean"]  # the same samples from the same seed and weights
    assert abs(a["actor/pg_loss"]) > 1e-4 and a["actor/grad_norm"] > 0  # a non-trivial step, not 0 == 0
    loss_tol, gn_tol = _first_step_bounds(tmp, a, b, dp)
    d_loss, d_gn = abs(a["actor/pg_loss"] - b["actor/pg_loss"]), abs(a["actor/grad_norm"] - b["actor/grad_norm"])
    print(f"[measured] {label} vs CP1 DP1, step 1: pg_loss {d_loss:.2e} (bound {loss_tol:.2e}), grad_norm {d_gn:.2e} "
          f"(bound {gn_tol:.2e}, grad_norm {a['actor/grad_norm']:.3f})")
    assert d_loss <= loss_tol, (a["actor/pg_loss"], b["actor/pg_loss"], loss_tol)
    # a gradient averaged over DP only (CP's shares summed), or a loss not scaled by CP, is off by a factor of 2
    assert d_gn <= gn_tol, (a["actor/grad_norm"], b["actor/grad_norm"], gn_tol)
    for m in got:  # every step's engine samples from the actor's distribution after the sync from the CP ranks
        assert m["rollout/logprob_abs_diff_mean"] < 1e-4, m


def test_cp2_dp2_first_step_equals_cp1_dp1(tp1):
    """`megarl train` on 4 ranks at CP2 x DP2: each DP rank's rows are split over its 2 CP ranks, and megatron averages
    the gradients over the 4 ranks of DP x CP (each loss scaled by CP). The first step's gradient norm and loss equal
    the single-rank run's on the same samples within the derived bounds."""
    tmp, ref, _, _ = tp1
    # one engine replica (on rank 0) instead of one per rank: half the CPU time of the run; the slow CP2 x TP2 test
    # below syncs an engine on every rank
    got, _, _ = _cli_run(tmp, "cp2dp2", ["parallelism.context_parallel_size=2", "trainer.n_gpus_per_node=4",
                                         "trainer.total_steps=2", "rollout.data_parallel_size=1"])
    assert [m["step"] for m in got] == [1, 2]
    _assert_first_step_equal(tmp, ref, got, 2, "CP2 x DP2")


@pytest.mark.slow  # 4 ranks and 4 engine replicas, about a minute and a half on 2 cores
def test_cp2_tp2_first_step_equals_cp1_dp1(tp1):
    """CP2 x TP2 on 4 ranks (one model replica, so DP1): the tensor-parallel shards of each CP rank's chunks; every
    rank's engine replica is synced from its rank's shards."""
    tmp, ref, _, _ = tp1
    got, _, _ = _cli_run(tmp, "cp2tp2", ["parallelism.context_parallel_size=2",
                                         "parallelism.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4",
                                         "trainer.total_steps=2"])
    assert [m["step"] for m in got] == [1, 2]
    _assert_first_step_equal(tmp, ref, got, 1, "CP2 x TP2")


def test_the_console_is_short_and_library_logs_go_to_the_run_dir(tp1):
    """A quiet console (a line per logged step and a summary); vLLM's and Megatron's own logs in <run_dir>/logs."""
    tmp, _, console, stderr = tp1
    assert len(console) <= 20, "\n".join(console)
    assert sum(line.startswith("step ") for line in console) == 3, "\n".join(console)
    assert any("train/reward_mean" in line for line in console)
    assert any(line.startswith("3 steps in ") for line in console)  # the summary
    logs = tmp / "tp1" / "logs"
    engine, rank = (logs / "vllm-engine.log").read_text(), (logs / "rank0.log").read_text()
    assert "Initializing a V1 LLM engine" in engine  # vLLM's start-up log
    assert "Params for bucket" in rank  # Megatron's DDP bucket list
    for noise in ("Initializing a V1 LLM engine", "Params for bucket", "UserWarning"):
        assert noise not in stderr


def test_missing_reward_file_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(RECIPE), *SMALL,
                        f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}",
                        "reward.reward_fn=no/such/file.py:score"], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "no/such/file.py" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # a second run; offload's round trip itself: tests/dist/test_trainer_offload.py
def test_offload_around_rollout_leaves_the_run_unchanged(tp1):
    """actor.offload and ref.offload move the trainer's states to host memory from each weight sync to the next
    forward (and bring them back for a checkpoint): the run is the same step for step, and the metrics show the cost."""
    tmp, base, _, _ = tp1
    got, _, _ = _cli_run(tmp, "offload", ["actor.offload=true", "ref.offload=true", "checkpoint.save_freq=2"])
    assert len(got) == len(base) == 3
    for a, b in zip(base, got):
        for key in ("actor/pg_loss", "actor/grad_norm", "train/reward_mean"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["offload/bytes"] > 0 and b["timing/onload_s"] >= 0 and b["timing/offload_s"] >= 0
    assert (tmp / "offload" / "checkpoints").exists() or any((tmp / "offload").rglob("step_2"))
