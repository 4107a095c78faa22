"""Stages of a step on a fake engine (one gloo rank): ReMax greedy baselines, DAPO metrics over every generation round,
validation in val_batch_size batches, saved rollouts, the epoch limit, forward micro-batch sizes."""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl import steps
from megarl.data import PromptLoader, PromptRecord
from megarl.metrics import combine_round_metrics, write_rollouts
from megarl.runtime import Runtime
from megarl.types import RolloutBatch
from megarl.validate import load_config

TINY = {"model": {"path": "unused", "create_tiny": {}}, "reward": {"num_workers": 0}}


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return Runtime(rank=0, world_size=1, dp_rank=0, dp_size=1, run_dir=Path("."))


class Tokenizer:
    """Token t decodes to the word 'w<t>'."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{int(t)}" for t in ids)


def _batch(responses: list[list[int]], prompts: list[list[int]], groups: list[int]) -> RolloutBatch:
    width = max(len(r) for r in responses)
    resp = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, :len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in responses])
    return RolloutBatch(prompt_ids=prompts, response_ids=resp, response_lengths=lengths,
                        rollout_logprobs=torch.zeros(len(responses), width), finish_reasons=["stop"] * len(responses),
                        truncated=torch.zeros(len(responses), dtype=torch.bool),
                        prompt_index=torch.tensor(groups), prompt_truncated=torch.zeros(len(responses), dtype=bool),
                        weight_version=0, pad_token_id=0,
                        metrics={"rollout/num_samples": float(len(responses)),
                                 "rollout/response_length_mean": float(lengths.float().mean()),
                                 "rollout/response_tokens": float(lengths.sum()), "rollout/generate_seconds": 1.0,
                                 "rollout/tokens_per_second": float(lengths.sum())})


class FakeEngine:
    """Prompt [p] answers with p tokens when greedy, else sample j of prompt [p] has p + j tokens (n=2), or p tokens
    for every sample when p is in `constant`. Records its calls."""

    def __init__(self, constant=()):
        self.calls = []
        self.constant = set(constant)

    def start_generate(self, prompt_token_ids, **kwargs):
        from megarl.rollout.protocol import Deferred

        return Deferred.ready(self.generate(prompt_token_ids, **kwargs))

    def generate(self, prompt_token_ids, validate=False, prompt_index=None, seed=None, greedy=False):
        self.calls.append({"prompts": [list(p) for p in prompt_token_ids], "greedy": greedy, "seed": seed,
                           "validate": validate})
        n = 1 if greedy or validate else 2
        responses, prompts, groups = [], [], []
        for k, p in enumerate(prompt_token_ids):
            for j in range(n):
                responses.append([7] * (p[0] + (0 if greedy or validate or p[0] in self.constant else j)))
                prompts.append(list(p))
                groups.append(prompt_index[k])
        return _batch(responses, prompts, groups)


def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str.split()))


def _records(lengths):
    return [PromptRecord(index=i, uid=f"f#{i}", prompt="", data_source="d", ground_truth="", prompt_ids=[p])
            for i, p in enumerate(lengths)]


def test_remax_baselines_are_the_greedy_rewards_of_each_samples_prompt(rt):
    cfg = load_config(data=TINY, overrides=["rollout.n=2", "algorithm.adv_estimator=remax"])
    engine, records = FakeEngine(), _records([3, 5])
    rollout = engine.generate([r.prompt_ids for r in records], prompt_index=[0, 1])
    baselines, metrics = steps.remax_baselines(engine, length_reward, records, rollout, Tokenizer(), cfg, rt)
    assert engine.calls[-1]["greedy"] is True
    # samples: prompt 0 -> 3, 4 tokens; prompt 1 -> 5, 6 tokens; greedy: 3 and 5 tokens, reward = token count
    assert baselines.tolist() == [3.0, 3.0, 5.0, 5.0]
    assert metrics["remax/baseline_reward_mean"] == 4.0
    # the advantage the trainer then computes: outcome reward minus baseline on every response token
    from megarl.batching import build_train_batch

    batch = build_train_batch(rollout, torch.tensor([3.0, 4.0, 5.0, 6.0]), 0)
    batch["reward_baselines"] = baselines
    steps.compute_advantages(cfg, batch)
    mask = batch["response_mask"]
    assert [sorted(set(batch["advantages"][i][mask[i]].tolist())) for i in range(4)] == [[0.0], [1.0], [0.0], [1.0]]


def test_dapo_metrics_cover_every_generation_round(rt):
    """Prompt [1]'s samples all have 1 token (equal rewards: the group is dropped); prompts [4] and [6] vary. With
    2 prompts per round and 2 wanted, round 1 ([1], [4]) keeps one group and round 2 ([1], [6]) the other."""
    cfg = load_config(data=TINY, overrides=["rollout.n=2", "algorithm.filter_groups.enable=true",
                                            "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"])
    loader = PromptLoader(_records([1, 4, 1, 6]), seed=0, shuffle=False)
    engine = FakeEngine(constant={1})

    def reward(data_source, solution_str, ground_truth, extra_info=None):  # acc: 1 for a 4-token response
        n = len(solution_str.split())
        return {"score": float(n), "acc": float(n == 4)}

    schedule = steps.rollout_schedule(cfg, loader)
    schedule.generation = steps.EngineGeneration(engine, None, None, cfg, rt)
    _, rollout, scores, metrics = steps.sample_batch(schedule, 1, engine, loader, reward, Tokenizer(), cfg, rt,
                                                     steps.Timer())
    assert metrics["reward/acc_mean"] == 1 / 8  # one 4-token response among the 8 generated (the last round has 0)
    assert metrics["dapo/gen_rounds"] == 2.0 and scores.tolist() == [4.0, 5.0, 6.0, 7.0]  # the kept groups
    assert rollout.metrics["rollout/num_samples"] == 8.0  # 4 per round, not the last round's 4
    # tokens generated: round 1: 1, 1, 4, 5; round 2: 1, 1, 6, 7
    assert rollout.metrics["rollout/response_tokens"] == 11 + 15
    assert rollout.metrics["rollout/response_length_mean"] == 26 / 8
    assert rollout.metrics["rollout/generate_seconds"] == 2.0  # 1 s per round


def test_combine_round_metrics_by_hand():
    rounds = [({"rollout/num_samples": 4.0, "rollout/response_length_mean": 2.0, "rollout/truncated_fraction": 0.5,
                "rollout/response_tokens": 8.0, "rollout/generate_seconds": 2.0, "rollout/tokens_per_second": 4.0,
                "reward/acc_mean": 1.0, "reward/timed_out": 1.0}, 4),
              ({"rollout/num_samples": 12.0, "rollout/response_length_mean": 4.0, "rollout/truncated_fraction": 0.0,
                "rollout/response_tokens": 48.0, "rollout/generate_seconds": 6.0, "rollout/tokens_per_second": 8.0,
                "reward/acc_mean": 0.0, "reward/timed_out": 0.0}, 12)]
    out = combine_round_metrics(rounds)
    assert out["rollout/num_samples"] == 16.0 and out["rollout/response_tokens"] == 56.0
    assert out["rollout/response_length_mean"] == (4 * 2 + 12 * 4) / 16  # 3.5
    assert out["rollout/truncated_fraction"] == 2 / 16
    assert out["rollout/generate_seconds"] == 8.0 and out["rollout/tokens_per_second"] == 56 / 8
    assert out["reward/acc_mean"] == 4 / 16 and out["reward/timed_out"] == 1.0


def test_validation_in_batches_scores_every_prompt_once_with_the_seeds_of_one_batch(rt):
    cfg = load_config(data=TINY, overrides=["rollout.n=2", "data.val_batch_size=2", "trainer.seed=100"])
    engine, records = FakeEngine(), _records([1, 2, 3, 4, 5])
    metrics = steps.validate(engine, length_reward, records, Tokenizer(), cfg, rt)
    assert [c["prompts"] for c in engine.calls] == [[[1], [2]], [[3], [4]], [[5]]]
    assert [c["seed"] for c in engine.calls] == [100, 102, 104]  # prompt i keeps seed + i * val n (n=1)
    assert metrics["val/reward_mean"] == 3.0 and metrics["val/d/reward_mean"] == 3.0


def test_write_rollouts_lines(tmp_path):
    rollout = _batch([[3, 4], [5]], [[1, 2], [1, 2]], [0, 0])
    batch = {"response_mask": torch.tensor([[False, True, True], [False, True, False]]),
             "advantages": torch.tensor([[0.0, 0.5, 0.5], [0.0, -0.5, 0.0]])}
    path = tmp_path / "rollouts" / "step_3.jsonl"
    write_rollouts(path, _records([1]), rollout, batch, torch.tensor([1.0, 0.0]), Tokenizer())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["w1 w2", "w1 w2"]
    assert [r["response"] for r in rows] == ["w3 w4", "w5"]
    assert [r["reward"] for r in rows] == [1.0, 0.0] and [r["advantages"] for r in rows] == [[0.5, 0.5], [-0.5]]
    assert rows[0]["uid"] == "f#0" and rows[1]["response_length"] == 1


@pytest.mark.parametrize("items,batch,drop_last,epochs,steps_,expected", [
    (10, 4, True, 1, 100, 2), (10, 4, False, 1, 100, 3), (10, 4, True, 3, 100, 6), (10, 4, True, 3, 5, 5)])
def test_total_epochs_caps_the_steps_and_the_loader_never_enters_the_next_epoch(items, batch, drop_last, epochs,
                                                                                 steps_, expected):
    from megarl.trainer import limit_to_epochs

    cfg = load_config(data=TINY, overrides=["rollout.n=2", f"data.train_batch_size={batch}",
                                            f"actor.ppo_mini_batch_size={batch}", f"trainer.total_steps={steps_}",
                                            f"trainer.total_epochs={epochs}", f"data.drop_last={drop_last}"])
    loader = PromptLoader(list(range(items)), seed=0, drop_last=drop_last)
    limited = limit_to_epochs(cfg, loader)
    assert limited.trainer.total_steps == expected
    for _ in range(limited.trainer.total_steps):
        loader.next_batch(batch)
    assert loader.epoch < epochs  # the run ends inside the last allowed epoch


def test_forward_micro_batch_is_not_shrunk_to_a_divisor():
    from megarl.megatron.workers import _micro

    assert _micro(7, 4) == 4  # 7 rows (prime): two forwards of 4 (the last padded), not seven of 1
    assert _micro(3, 32) == 3 and _micro(64, 32) == 32


def test_model_and_parallelism_settings_reach_the_model_build():
    from megarl.megatron.workers import build_options

    cfg = load_config(data=TINY, overrides=["rollout.n=2", "trainer.device=cuda", "model.dtype=bfloat16",
                                            "model.use_transformer_engine=false", "model.recompute=full",
                                            "parallelism.sequence_parallel=true", "trainer.n_gpus_per_node=2",
                                            "parallelism.tensor_model_parallel_size=2"])
    opts = build_options(cfg)
    assert (opts["dtype"], opts["use_te"], opts["sequence_parallel"]) == (torch.bfloat16, False, True)
    assert opts["recompute_granularity"] == "full"
    defaults = build_options(load_config(data=TINY, overrides=["rollout.n=2"]))
    assert (defaults["dtype"], defaults["use_te"], defaults["sequence_parallel"]) == (None, None, None)


def test_no_mismatch_metrics_without_rollout_logprobs():
    """rollout.calculate_log_probs=false: nothing is compared against the zeros that stand in for engine logprobs."""
    from megarl.batching import build_train_batch

    rollout = _batch([[3, 4], [5]], [[1, 2], [1, 2]], [0, 0])
    batch = build_train_batch(rollout, torch.tensor([1.0, 0.0]), 0)
    batch["old_log_probs"] = torch.full_like(batch["rollout_log_probs"], -0.5)
    batch["advantages"] = torch.zeros_like(batch["old_log_probs"])
    with_engine = steps.batch_metrics(batch, rollout, torch.tensor([1.0, 0.0]))
    assert with_engine["rollout/logprob_abs_diff_mean"] == 0.5  # -0.5 against the engine's 0.0 logprobs
    rollout.rollout_logprobs = None
    without = steps.batch_metrics(batch, rollout, torch.tensor([1.0, 0.0]))
    assert not [k for k in without if k.startswith(("rollout/", "rollout_", "training_", "mismatch_"))]
    assert without["train/reward_mean"] == 0.5


def test_trainer_device_is_applied_at_start(monkeypatch):
    from megarl.runtime import use_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    use_device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # hidden from this process and the engine child it starts
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="trainer.device=cuda but no CUDA device"):
            use_device("cuda")


def test_lr_schedule_spans_every_optimizer_step_of_the_run():
    """4 mini-batches per step x 2 epochs = 8 optimizer steps per RL step, 10 steps: the decay spans 80 (the critic's
    own epochs count for its schedule)."""
    from megarl.megatron.workers import run_optimizer_steps
    from megarl.validate import load_config

    cfg = load_config(data=TINY, overrides=["rollout.n=2", "data.train_batch_size=32", "actor.ppo_mini_batch_size=8",
                                            "actor.ppo_epochs=2", "critic.ppo_epochs=3", "trainer.total_steps=10"])
    assert run_optimizer_steps(cfg, cfg.actor.ppo_epochs) == 80
    assert run_optimizer_steps(cfg, cfg.critic.ppo_epochs) == 120
