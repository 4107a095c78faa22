"""`megarl plan --search`: validate's own rules decide what is valid, the best layout is never worse than the recipe's
own on the planner's figures, and the counted holdings the search plans with agree with the sync plan's."""
import json
from pathlib import Path

import pytest

from megarl.plan import PlanError
from megarl.plan.counts import counted_weights
from megarl.plan.model import Cluster, model_weights, place
from megarl.plan.search import search, stage_splits, with_settings, write_recipe
from megarl.validate import load_config, run_checks

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "grpo_tiny_cpu.yaml"


def _tiny(gpus: int):
    return load_config(TINY, [f"trainer.n_gpus_per_node={gpus}"])


def test_uneven_stage_splits_follow_megatrons_rule():
    assert stage_splits(80, 4) == [(None, None)]
    assert stage_splits(61, 16) == [(1, 4), (2, 3)]  # DeepSeek-V3: 14 middle stages of 4
    assert stage_splits(61, 2) == [(30, None)]


@pytest.mark.parametrize("model,tp,pp", [("qwen2_5_7b_instruct", 2, 2), ("qwen3_30b_a3b", 2, 2)])
def test_counted_holdings_agree_with_the_sync_plan(model, tp, pp):
    """At expert TP = TP (where the sync plan's holdings are exact)."""
    hf = json.loads((ROOT / "recipes" / "models" / model / "config.json").read_text())
    moe = "num_experts" in hf
    cfg = load_config(TINY, [f"model.config_path={ROOT / 'recipes' / 'models' / model / 'config.json'}",
                             "trainer.n_gpus_per_node=8", f"parallelism.tensor_model_parallel_size={tp}",
                             f"parallelism.pipeline_model_parallel_size={pp}", "parallelism.sequence_parallel=true",
                             "rollout.tensor_model_parallel_size=2", "model.create_tiny=null",
                             "rollout.max_model_len=64",
                             *(["parallelism.expert_model_parallel_size=2", "actor.use_dynamic_bsz=false",
                                "actor.ppo_micro_batch_size_per_gpu=1"] if moe else [])])
    pl = place(cfg, Cluster(1, 8, 80, 50))
    exact, counted = model_weights(hf, pl), counted_weights(hf, pl)
    for a, b in zip(exact.held, counted.held):
        assert abs(a - b) / a < 0.01, (exact.held, counted.held)
    assert abs(max(exact.loaded.values()) - max(counted.loaded.values())) / max(exact.loaded.values()) < 0.01


def test_search_on_the_tiny_recipe_with_2_ranks_picks_a_valid_layout_never_worse_than_its_own():
    cfg = _tiny(2)
    res = search(cfg, 1, 2, 80, 50, 2048, top=3)
    assert res.enumerated > res.valid > 0 and res.fitting > 0 and res.best
    assert res.best[0].time.total <= res.own.time.total
    for cand in res.best:
        assert not [i for i in run_checks(with_settings(cfg, cand.settings)) if not i.warning], cand.settings


def test_rejected_families_name_validates_rule():
    res = search(_tiny(4), 1, 4, 80, 50, 2048, top=1)
    # the tiny model has 2 KV heads: TP 4 does not split them (validate's check_model_layout)
    assert "must divide num_key_value_heads = 2" in res.rejected["TP 4 PP 1"], res.rejected
    assert "must be a multiple of TP*PP*CP = 4*2*1 = 8" in res.rejected["TP 4 PP 2"]


def test_write_recipe_puts_the_settings_into_a_copy(tmp_path):
    out = tmp_path / "best.yaml"
    write_recipe(str(TINY), {"parallelism.tensor_model_parallel_size": 2, "parallelism.sequence_parallel": True,
                             "trainer.n_gpus_per_node": 2, "actor.offload.params": True}, str(out))
    cfg = load_config(out)
    assert cfg.parallelism.tensor_model_parallel_size == 2 and cfg.world_size == 2 and cfg.actor.offload.params


def test_search_refuses_a_cluster_that_cannot_plan_with_one_line():
    with pytest.raises(PlanError) as err:
        search(with_settings(_tiny(2), {"model.create_tiny": None, "model.path": "does/not/exist"}), 1, 2, 80, 50, 2048)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)


def test_train_refuses_on_a_gpu_the_plan_says_is_too_small_and_can_be_told_to_start(monkeypatch):
    from megarl import cli
    from megarl.plan import preflight

    cfg = _tiny(2)
    # the tiny model's states are nothing; the GPU holds the engine's 0.5 share and the CUDA context (1 GiB)
    assert preflight.plan_check(cfg, None) is None  # CPU: nothing to plan against
    assert preflight.plan_check(cfg, 80 * 1024 ** 3) is None
    refusal = preflight.plan_check(cfg, 1024 ** 3)  # a simulated 1 GiB device
    assert refusal.startswith("megarl train: the memory plan says this recipe does not fit: the ")
    assert "GiB per GPU of 1.0 GiB" in refusal and "--no-plan-check" in refusal and "\n" not in refusal
    assert "The layout search found no layout that fits" in refusal
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda: 1024 ** 3)
    started = []
    monkeypatch.setattr(cli, "_run_job", lambda cfg, entry: started.append(entry) or 0)
    assert cli.main(["train", str(TINY), "trainer.n_gpus_per_node=2"]) == 1 and not started
    assert cli.main(["train", str(TINY), "trainer.n_gpus_per_node=2", "--no-plan-check"]) == 0 and started


def test_expert_tp_1_holds_whole_experts_in_the_plan():
    """GLM-4.5-Air at TP2 EP8 ETP1: each rank holds its 16 experts per layer whole (the sync plan splits experts over
    TP, so megarl.plan.model.model_weights counts them from the mapping there), and expert DP is 2."""
    # at expert TP 1 (the recipe runs 2): every rank holds its experts whole
    cfg = load_config(ROOT / "recipes" / "grpo_glm4_5_air.yaml", ["parallelism.expert_tensor_parallel_size=1"])
    pl = place(cfg, Cluster(8, 8, 80, 50))
    assert pl.edp == 64 // (1 * 8 * 4)
    hf = json.loads((ROOT / "recipes" / "models" / "glm4_5_air" / "config.json").read_text())
    counted = counted_weights(hf, pl)
    # 12 MoE layers on the last stage, 128 experts of 3 x 4096 x 1408 (moe_intermediate_size), 16 per rank, bf16
    experts = 12 * 16 * 3 * hf["hidden_size"] * hf["moe_intermediate_size"] * 2
    assert abs(counted.expert[-1] - experts) / experts < 0.01
