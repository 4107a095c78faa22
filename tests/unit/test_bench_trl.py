"""bench/bench_trl.py's pure parts: the recipe -> TRL GRPOConfig mapping (values derived by hand from a small config
written here), what it refuses, the FLOP formula, step summaries and the table. No TRL import."""
import importlib.util
import sys
from pathlib import Path

import pytest

from megarl.config.schema import MegarlConfig

ROOT = Path(__file__).resolve().parents[2]


def _load():
    # bench/ is not a package; a private module name keeps it off any other import
    spec = importlib.util.spec_from_file_location("_megarl_bench_trl", ROOT / "bench" / "bench_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bt = _load()


def config(**sections) -> MegarlConfig:
    base = {
        "data": {"train_batch_size": 8},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "clip_ratio_low": 0.2,
                  "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean", "use_kl_loss": True, "kl_loss_coef": 0.001,
                  "ppo_epochs": 2,
                  "optim": {"lr": 3e-6, "betas": [0.9, 0.95], "eps": 1e-7, "weight_decay": 0.1, "clip_grad": 0.5,
                            "lr_decay_style": "cosine", "min_lr": 1e-7, "lr_warmup_steps": 3}},
        "rollout": {"n": 4, "temperature": 0.9, "top_p": 0.95, "top_k": -1, "response_length": 64,
                    "prompt_length": 128},
        "trainer": {"seed": 5, "total_steps": 40},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return MegarlConfig.model_validate(base)


def test_mapping_by_hand():
    kw = bt.grpo_config_kwargs(config(), "/tmp/out", steps=10, seed=7)
    # B=8 prompts, n=4, mini-batch M=4 prompts = 16 sequences, micro-batch 2 -> 8 accumulation micro-steps;
    # 8/4 = 2 mini-batches per batch -> 16 micro-batches per generation (= 8*4 / 2); 2 epochs -> 4 optimizer steps
    # per RL step, 40 for 10 RL steps
    assert kw["per_device_train_batch_size"] == 2
    assert kw["gradient_accumulation_steps"] == 8
    assert kw["steps_per_generation"] == 16
    assert kw["per_device_train_batch_size"] * kw["steps_per_generation"] == 8 * 4  # generation batch = B*n
    assert kw["num_generations"] == 4
    assert kw["num_iterations"] == 2
    assert kw["max_steps"] == 40
    assert kw["loss_type"] == "dapo"
    assert kw["beta"] == 0.001
    assert (kw["epsilon"], kw["epsilon_high"]) == (0.2, 0.28)
    assert kw["scale_rewards"] == "group"
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.9, 0.95, 0)
    assert kw["max_completion_length"] == 64
    assert kw["learning_rate"] == 3e-6
    assert kw["lr_scheduler_type"] == "cosine_with_min_lr" and kw["lr_scheduler_kwargs"] == {"min_lr": 1e-7}
    assert kw["warmup_steps"] == 3
    assert (kw["optim"], kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"]) == ("adamw_torch", 0.9, 0.95, 1e-7)
    assert kw["weight_decay"] == 0.1 and kw["max_grad_norm"] == 0.5
    assert (kw["seed"], kw["shuffle_dataset"]) == (7, False)
    assert (kw["use_cpu"], kw["bf16"], kw["fp16"], kw["gradient_checkpointing"]) == (True, False, False, False)
    assert kw["output_dir"] == "/tmp/out"


def test_mapping_variants():
    # one update per step, no KL, Dr.GRPO, dynamic batches (one micro-batch = the mini-batch), constant LR
    cfg = config(actor={"ppo_mini_batch_size": 8, "ppo_epochs": 1, "use_kl_loss": False, "use_dynamic_bsz": True,
                        "loss_agg_mode": "seq-mean-token-sum-norm", "clip_ratio_low": None, "clip_ratio_high": None,
                        "clip_ratio": 0.3, "optim": {"lr": 1e-6, "lr_decay_style": "constant"}},
                 algorithm={"adv_estimator": "drgrpo"})
    kw = bt.grpo_config_kwargs(cfg, "o", steps=3, seed=1)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["steps_per_generation"]) \
        == (32, 1, 1)
    assert kw["max_steps"] == 3 and kw["num_iterations"] == 1
    # a token budget of 2000 holds 2000 // (128 + 64) = 10 rows at the longest; the largest divisor of 32 in it: 8
    small = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"ppo_max_token_len_per_gpu": 2000})})
    kw_small = bt.grpo_config_kwargs(small, "o", steps=3, seed=1)
    assert (kw_small["per_device_train_batch_size"], kw_small["gradient_accumulation_steps"],
            kw_small["steps_per_generation"]) == (8, 4, 4)
    assert kw["loss_type"] == "dr_grpo" and kw["scale_rewards"] == "none" and kw["beta"] == 0.0
    assert (kw["epsilon"], kw["epsilon_high"]) == (0.3, 0.3)
    assert kw["lr_scheduler_type"] == "constant" and "lr_scheduler_kwargs" not in kw
    assert not bt.separate_old_logprob_pass(cfg) and bt.forward_only_passes(cfg) == 0
    # the KL loss adds the reference's forward; several updates per batch the old-logprob pass
    assert bt.forward_only_passes(config()) == 2
    assert bt.lr_schedule(config(actor={"optim": {"lr_decay_style": "linear", "min_lr": 0.0}}).actor.optim) \
        == ("linear", {})
    assert bt.lr_schedule(config(actor={"optim": {"lr_decay_style": "linear", "min_lr": 1e-8}}).actor.optim) \
        == ("polynomial", {"lr_end": 1e-8, "power": 1.0})
    assert bt.lr_schedule(config(actor={"optim": {"lr_decay_style": "constant", "lr_warmup_steps": 2}}).actor.optim) \
        == ("constant_with_warmup", {})
    assert bt.grpo_config_kwargs(config(actor={"loss_agg_mode": "seq-mean-token-mean"}), "o", 1, 1)["loss_type"] \
        == "grpo"


@pytest.mark.parametrize("sections, key", [
    ({"actor": {"loss_agg_mode": "seq-mean-token-sum"}}, "actor.loss_agg_mode"),
    ({"actor": {"kl_loss_type": "mse"}}, "actor.kl_loss_type"),
    ({"algorithm": {"adv_estimator": "rloo"}}, "algorithm.adv_estimator"),
    ({"rollout": {"n": 1}}, "rollout.n"),
    ({"actor": {"policy_loss": "gspo"}}, "actor.policy_loss"),
    ({"trainer": {"mode": "one_step_off_policy"}}, "trainer.mode"),
])
def test_refused(sections, key):
    cfg = config(**sections)
    assert any(p.startswith(key) for p in bt.unmatchable(cfg))
    with pytest.raises(bt.Unmatchable, match=key):
        bt.grpo_config_kwargs(cfg, "o", 1, 1)


def test_settings_table_and_notes_name_every_setting():
    cfg = config()
    table = bt.settings_table(cfg, bt.grpo_config_kwargs(cfg, "o", 2, 1))
    names = " ".join(name for name, _, _ in table)
    for setting in ("loss_type", "beta", "num_iterations", "scale_rewards", "epsilon_high", "num_generations",
                    "generation_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "max_prompt_length", "max_completion_length", "temperature", "top_p", "learning_rate",
                    "lr_scheduler_type", "adam_beta1", "weight_decay", "max_grad_norm"):
        assert setting in names, setting
    assert dict((n, v) for n, v, _ in table)["generation_batch_size"] == 32
    notes = " ".join(bt.unequal_notes(cfg))
    # two mini-batches: the token-mean denominator differs; the LR decay spans optimizer steps on both sides
    assert "token-mean with several mini-batches" in notes and "LR decay" not in notes
    assert "token-mean with several" not in " ".join(bt.unequal_notes(config(actor={"ppo_mini_batch_size": 8,
                                                                                  "ppo_epochs": 1})))


def test_flops_formula():
    f = bt.update_flops(params=100, trained_tokens=50, ppo_epochs=2, forward_passes=1)
    assert f == {"train": 6 * 100 * 50 * 2, "forward_only": 2 * 100 * 50, "total": 60000 + 10000}
    assert bt.matmul_gflops(1000, 0.5) == pytest.approx(2 * 1000 ** 3 / 0.5 / 1e9)


def test_step_summaries():
    assert bt.step_times([10.0, 12.0, 15.0], start=4.0) == [6.0, 2.0, 3.0]
    assert bt.step_times([10.0, 12.0], first=1.5) == [1.5, 2.0]
    steps = [{"seconds": 9.0}, {"seconds": 2.0}, {"seconds": 4.0}, {"seconds": 3.0}]
    s = bt.summarize_steps(steps, [100, 1000, 2000, 1000])
    assert s["seconds"] == 3.0 and s["steps_in_median"] == 3  # the first step left out
    assert s["s_per_1k_tokens"] == 2.0  # median of 2.0, 2.0, 3.0
    assert bt.summarize_steps([{"seconds": 5.0}], [500])["seconds"] == 5.0  # a 1-step run keeps its step


def test_table():
    run = {"seconds": 2.0, "s_per_1k_tokens": 1.0, "peak_rss_gib": 3.0, "peak_pss_gib": 2.5, "update_gflops": 4.0,
           "update_of_matmul": 0.1, "val_before": 0.25, "val_after": 0.5}
    other = {**run, "seconds": 4.0, "peak_rss_gib": 1.5, "val_after": 0.375}
    text = bt.format_table({"megarl": {1: run}, "trl": {1: other}})
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["side", "seed"]
    assert any(line.startswith("megarl/TRL") for line in lines)
    ratio_line = next(line for line in lines if line.startswith("megarl/TRL"))
    assert "0.50" in ratio_line and "2.00" in ratio_line  # s/step 2/4, peak RSS 3/1.5
    assert "0.250 -> 0.500" in text and "0.500 vs 0.375" in ratio_line
    assert "megarl/TRL" not in bt.format_table({"trl": {1: other}})


def test_bf16_only_where_asked_native_and_accepted():
    assert bt.bf16_decision(False, {"avx512_bf16"}, None)[0] is False
    used, why = bt.bf16_decision(True, {"avx2"}, None)
    assert not used and "none of" in why
    used, why = bt.bf16_decision(True, {"amx_bf16"}, "model.dtype: CPU float32 only")
    assert not used and "CPU float32 only" in why
    assert bt.bf16_decision(True, {"amx_bf16"}, None)[0] is True
    # the mapping follows the recipe's dtype, so both sides get bf16 from the same overrides
    assert bt.grpo_config_kwargs(config(model={"dtype": "bfloat16"}), "o", 1, 1)["bf16"] is True
    assert bt.grpo_config_kwargs(config(), "o", 1, 1)["bf16"] is False
    assert any(p.startswith("model.dtype") for p in bt.unmatchable(config(model={"dtype": "float16"})))
