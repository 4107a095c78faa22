"""The planner in tokens: micro-batches counted from measured response lengths (rows packed) beside the worst case
(every row at full length); hand-derived token counts."""
import json
from pathlib import Path

import pytest

from megarl.plan.counts import counted_weights
from megarl.plan.memory import Lengths, micro_tokens, rank_tokens, read_lengths
from megarl.plan.model import Cluster, PlanError, read_model_config
from megarl.plan.planner import plan_steps
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_fixed_micro_batch_holds_the_longest_row_and_mean_rows():
    # 8 rows, longest 1000 tokens, mean 400; 4 rows per micro-batch: the micro-batch holding the longest row has it
    # plus 3 rows of the mean: 1000 + 3 * 400; worst case 4 x 1000
    assert micro_tokens(8, 1000, 4, False, 0, 400) == (2200, 2)
    assert micro_tokens(8, 1000, 4, False, 0) == (4000, 2)
    # one row per micro-batch: the longest row alone, whatever the mean
    assert micro_tokens(8, 1000, 1, False, 0, 400) == (1000, 8)
    # a micro-batch above the rank's rows holds them all: 8 x 400 = 3200 tokens, not 1000 + 7 x 400
    assert micro_tokens(8, 1000, 16, False, 0, 400) == (3200, 1)


def test_token_budget_packs_the_measured_rows():
    # 8 rows of mean 400 = 3200 tokens; a budget of 3000 gives two micro-batches of at most 3000
    assert micro_tokens(8, 1000, 1, True, 3000, 400) == (3000, 2)
    # a budget under the longest row still takes that row: 1000-token micro-batches, ceil(3200 / 1000) of them
    assert micro_tokens(8, 1000, 1, True, 500, 400) == (1000, 4)
    # a budget over the mini-batch: one micro-batch of it (the worst case would be 8000)
    assert micro_tokens(8, 1000, 1, True, 10_000, 400) == (3200, 1)
    assert micro_tokens(8, 1000, 1, True, 10_000) == (8000, 1)


def test_cp_pads_each_packed_row():
    # 2200 tokens in rows of mean 400: ceil(5.5) = 6 rows, each padded to a multiple of 2 x CP2 = 4 (at most 3 more),
    # the pack split over 2 ranks: ceil((2200 + 6 * 3) / 2)
    assert rank_tokens(2200, 400, 2) == 1109
    assert rank_tokens(2200, 400, 1) == 2200


def _steps(lengths=None):
    recipe = ROOT / "recipes" / "ppo_llama3_70b.yaml"
    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    cfg = load_config(recipe, [f"model.config_path={config}", "trainer.nnodes=16", "trainer.n_gpus_per_node=8"])
    return plan_steps(cfg, Cluster(16, 8, 80, 50.0), read_model_config(cfg), weights_fn=counted_weights,
                      lengths=lengths)


def test_measured_lengths_shrink_the_activations_by_the_token_ratio():
    # ppo_llama3_70b: one row per micro-batch, prompt 1024 + response 2048 = 3072 tokens in the worst case; measured
    # responses of mean 500, longest 1500: the micro-batch is the longest row, 1024 + 1500 = 2524 tokens
    worst, measured = _steps(), _steps(Lengths(500, 1500))
    assert worst.roles.actor_tokens == 3072 and measured.roles.actor_tokens == 2524
    # stored activations (and the logits on the last stage) are linear in the micro-batch's tokens
    for w, m in zip(worst.roles.models[0].activations, measured.roles.models[0].activations):
        assert m == pytest.approx(w * 2524 / 3072, rel=1e-6)
    assert measured.peak.phases["update"] < worst.peak.phases["update"]  # the generate phase is the engine's
    assert "worst case: every row at full length (1024 prompt + 2048 response" in worst.roles.token_basis
    assert "measured" in measured.roles.token_basis and "mean 500, longest 1500" in measured.roles.token_basis


def test_lengths_are_read_from_a_runs_metrics(tmp_path):
    rows = [{"step": 1, "train/response_length_mean": 300.5, "train/response_length_max": 900},
            {"step": 2, "actor/kl": 0.0},
            {"step": 3, "train/response_length_mean": 420.0, "train/response_length_max": 800}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_lengths(str(tmp_path))
    assert (got.mean_response, got.max_response) == (420.0, 900)  # the largest mean, the longest of any step
    (tmp_path / "empty.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(PlanError, match="train/response_length_mean"):
        read_lengths(str(tmp_path / "empty.jsonl"))
    with pytest.raises(PlanError, match="no such file"):
        read_lengths(str(tmp_path / "absent"))


def test_the_options_give_lengths_or_name_what_is_wrong():
    from argparse import Namespace

    from megarl.plan import response_lengths

    def args(path=None, mean=None, longest=None):
        return Namespace(response_lengths=path, mean_response_tokens=mean, max_response_tokens=longest)

    assert response_lengths(args(), 2048) is None
    assert response_lengths(args(mean=500, longest=1500), 2048) == Lengths(500, 1500, "given")
    with pytest.raises(PlanError, match="go together"):
        response_lengths(args(mean=500), 2048)
    with pytest.raises(PlanError, match="one or the other"):
        response_lengths(args("run", 500, 1500), 2048)
    with pytest.raises(PlanError, match="mean <= longest"):
        response_lengths(args(mean=1600, longest=1500), 2048)
    with pytest.raises(PlanError, match="rollout.response_length=2048"):
        response_lengths(args(mean=500, longest=4096), 2048)


def test_long_tail_lengths_have_the_longest_and_the_median_asked():
    from megarl.plan.measure import long_tail_lengths

    lengths = long_tail_lengths(9, 96, 16, seed=3)
    assert len(lengths) == 9 and max(lengths) == 96
    assert sorted(lengths)[4] == 6  # the median row: 96 / 16 exactly
    assert min(lengths) >= 1
    assert long_tail_lengths(1, 96, 16, seed=3) == [96]


def test_a_long_tail_synthetic_batch_masks_each_rows_own_response():
    from types import SimpleNamespace

    from megarl.batching import sequence_lengths
    from megarl.plan.measure import synthetic_batch

    r = SimpleNamespace(n=2, prompt_length=4, response_length=8)
    cfg = SimpleNamespace(rollout=r, data=SimpleNamespace(train_batch_size=2), routes_from_engine=False)
    batch = synthetic_batch(cfg, SimpleNamespace(vocab_size=50, is_moe=False), 0, [8, 1, 3, 5])
    assert batch["input_ids"].shape == (4, 12)
    assert batch["response_mask"].sum(dim=1).tolist() == [8, 1, 3, 5]
    assert sequence_lengths(batch).tolist() == [12, 5, 7, 9]  # prompt + response
    # a row's reward sits on its last response token's logprob position, p - 1 + length - 1
    for row, n in enumerate([8, 1, 3, 5]):
        assert batch["token_level_scores"][row].nonzero().flatten().tolist() in ([], [4 - 2 + n])
        assert (batch["input_ids"][row, 4 + n:] == 0).all()


@pytest.mark.parametrize("cp", [1, 2])
def test_a_token_budget_over_the_measured_mini_batch_takes_it_whole_and_cp_pads_each_row(cp):
    # grpo_tiny_cpu: 32 prompts x 8 samples = 256 rows on one DP rank, prompts of 16 tokens, a 16384-token budget per
    # GPU. Measured responses of mean 5, longest 6: the mini-batch is 256 x (16 + 5) = 5376 tokens, under the budget,
    # so one micro-batch of 5376 (the worst case: 256 x (16 + 8) = 6144). At CP2 each 21-token row is padded to 24 (a
    # multiple of 2 x CP) and split over the 2 ranks: 256 x 24 / 2 = 3072 tokens on a rank.
    extra = [] if cp == 1 else ["trainer.n_gpus_per_node=2", "parallelism.context_parallel_size=2"]
    cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", extra)
    cluster = Cluster(1, cp, 80, 50.0)
    measured = plan_steps(cfg, cluster, read_model_config(cfg), lengths=Lengths(5, 6))
    worst = plan_steps(cfg, cluster, read_model_config(cfg))
    assert (measured.roles.actor_micro_tokens, measured.roles.actor_micro_batches) == (5376, 1)
    assert worst.roles.actor_micro_tokens == 6144
    assert measured.roles.actor_tokens == (5376 if cp == 1 else 3072)
