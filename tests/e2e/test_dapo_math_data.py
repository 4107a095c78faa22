"""DAPO-Math-17k rows, prepared by tools/data/dapo_math.py from hand-written rows in the official layout, train a 3-step
run of recipes/dapo_tiny_cpu.yaml, scored by the math_dapo rule the rows' data_source routes to.

The tiny recipe's word-level tokenizer knows only the arithmetic task's words: the official instruction around each
question encodes to <unk> tokens (63 prompt tokens in all, hence rollout.prompt_length=64) and the model cannot write
'Answer:', so every sample scores verl's -1 (acc 0). DAPO's dynamic sampling keeps only groups whose acc varies and
would draw rounds until it gave up; it is off here (a run where it keeps groups: tests/e2e/test_dapo_gspo_ppo.py)."""
import json
from pathlib import Path

import pytest

from megarl.launch_local import run_ranks
from megarl.validate import load_config
from tests.helpers.dapo_rows import load_script, official_row

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "dapo_tiny_cpu.yaml"

# 20 distinct questions, each repeated 1-3 times as the official file repeats its prompts
QUESTIONS = [(f"What is {a} + {b} ?", str(a + b)) for a, b in
             [(3, 5), (7, 9), (12, 4), (6, 6), (1, 19), (8, 2), (10, 10), (4, 15), (11, 3), (9, 9),
              (2, 17), (5, 14), (13, 6), (16, 1), (0, 20), (18, 2), (7, 7), (3, 12), (14, 5), (6, 13)]]


@pytest.mark.slow  # a tiny model, a vLLM engine, a validation pass and 3 steps: 73-84 s on 2 shared cores
def test_prepared_dapo_rows_train_three_steps(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [official_row(q, a, f"uuid-{i}") for i, (q, a) in enumerate(QUESTIONS) for _ in range(1 + i % 3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo-math-17k.parquet")
    assert load_script().main(["--input", str(tmp_path / "dapo-math-17k.parquet"), "--out-dir",
                               str(tmp_path / "data"), "--val-size", "4"]) == 0
    run = tmp_path / "run"
    cfg = load_config(RECIPE, [
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'val.parquet'}]",
        f"trainer.run_dir={run}", f"model.path={tmp_path / 'model'}", f"data.synthetic.output_dir={tmp_path / 'syn'}",
        "sft.enable=false", "data.synthetic.num_train=16", "data.synthetic.num_val=4",
        "rollout.prompt_length=64", "algorithm.filter_groups.enable=false", "rollout.over_sample_rate=0",
        "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=8", "rollout.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_steps=3", "trainer.test_freq=0", "trainer.val_before_train=true", "logging.tensorboard=false"])
    assert cfg.reward.reward_fn is None  # routed by the rows' data_source
    run_ranks("megarl.trainer:train_entry", cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=600)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "train/reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # math_dapo's -1 for an unread answer (the arithmetic rule would give 0), its acc metric logged
        assert m["reward/acc_mean"] == 0.0
        # every sample -1, plus DAPO's overlong penalty (<= 0) where a response runs into the buffer
        assert abs(m["train/reward_mean"] - (-1.0 + m["reward/overlong_penalty_mean"])) < 1e-6, m
    val = [m for m in lines if "val/math_dapo/reward_mean" in m]
    assert val and val[0]["val/math_dapo/reward_mean"] <= -1.0
