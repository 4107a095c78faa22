"""A run whose reward is composed of two rule functions and a reward model (reward.components): every component is
logged (reward/<name>_mean) and recorded per sample (logging.save_rollouts) as configured, and the total is their
weighted combination after normalize/clip. The references are computed here: the rules by hand, the reward model's
scores by HF AutoModelForSequenceClassification on the sample's ids."""
import json
import re
from pathlib import Path

import pytest
import torch

from megarl.launch_local import run_ranks
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["sft.enable=false", "data.synthetic.num_train=64", "data.synthetic.num_val=8", "data.train_batch_size=8",
         "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
         "rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.total_steps=2", "trainer.test_freq=0",
         "trainer.val_before_train=false", "logging.tensorboard=false", "logging.save_rollouts=true"]
PARITY = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return float(len(solution_str.split()) % 2)\n"


def _make_reward_model(tmp: Path) -> Path:
    """A random LlamaForSequenceClassification with the synthetic task's tokenizer (the policy's)."""
    import transformers

    from megarl.config.schema import TinyModelSpec
    from megarl.prepare import create_tiny_model

    lm = create_tiny_model(TinyModelSpec(), tmp / "rm_base", seed=5)
    config = transformers.AutoConfig.from_pretrained(str(lm))
    config.num_labels, config.architectures = 1, ["LlamaForSequenceClassification"]
    torch.manual_seed(5)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores that vary a lot between samples
    model.save_pretrained(str(tmp / "rm"))
    transformers.AutoTokenizer.from_pretrained(str(lm)).save_pretrained(str(tmp / "rm"))
    return tmp / "rm"


@pytest.mark.slow
def test_components_are_logged_and_combined_as_configured(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.data import read_rows

    rm = _make_reward_model(tmp_path)
    (tmp_path / "parity.py").write_text(PARITY)
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", SMALL + [
        f"trainer.run_dir={run_dir}", f"model.path={tmp_path / 'model'}", f"data.synthetic.output_dir={tmp_path / 'd'}",
        "reward.reward_model.enable=true", f"reward.reward_model.path={rm}",
        f"reward.components={{parity: {{fn: '{tmp_path / 'parity.py'}'}}, "
        "fmt: {fn: format_regex, kwargs: {pattern: '^####'}, weight: 0.5, clip: [0, 0.5]}, "
        "rm: {type: reward_model, weight: 2.0, normalize: true, clip: [-1, 1]}}"])
    run_ranks("megarl.trainer:train_entry", 1, {"cfg_dict": cfg.model_dump()}, timeout=900)

    tok = AutoTokenizer.from_pretrained(str(rm))
    hf = AutoModelForSequenceClassification.from_pretrained(str(rm), dtype=torch.float32)
    prompts = {f"train.parquet#{i}": row["prompt"] for i, row in enumerate(read_rows(str(tmp_path / "d" /
                                                                                          "train.parquet")))}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{m['step']}.jsonl").read_text().splitlines()]
        assert len(rows) == 32
        parity = torch.tensor([float(len(r["response"].split()) % 2) for r in rows])
        fmt = torch.tensor([1.0 if re.search("^####", r["response"]) else 0.0 for r in rows])
        got = {k: torch.tensor([r["reward_components"][k] for r in rows]) for k in ("parity", "fmt", "rm")}
        assert torch.equal(got["parity"], parity) and torch.equal(got["fmt"], fmt)
        # the reward model's scores: HF on the sample's ids, rebuilt from its text. A random policy also samples
        # special tokens, which the recorded text leaves out: those samples (their token count gives them away) are
        # not rebuilt
        compared = 0
        for r, score in zip(rows, got["rm"].tolist()):
            prompt = tok.apply_chat_template(list(prompts[r["uid"]]), add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            response = tok.encode(r["response"], add_special_tokens=False)
            if r["finish_reason"] == "stop":
                response.append(tok.eos_token_id)  # the engine's response ends with the EOS it stopped on
            if len(response) != r["response_length"]:
                continue
            with torch.no_grad():
                want = hf(input_ids=torch.tensor([prompt + response])).logits[0, 0].item()
            assert abs(score - want) <= 1e-5 * max(1.0, abs(want)), (r, score, want)
            compared += 1
        assert compared >= 8, compared
        rm_scores = got["rm"]
        assert rm_scores.std() > 0.1 and 0 < parity.mean() < 1  # components that vary
        normalized = ((rm_scores - rm_scores.mean()) / (rm_scores.std(unbiased=False) + 1e-6)).clamp(-1, 1)
        total = parity + 0.5 * fmt.clamp(0, 0.5) + 2.0 * normalized
        assert torch.allclose(torch.tensor([r["reward"] for r in rows]), total, atol=1e-5)
        assert m["reward/parity_mean"] == pytest.approx(parity.mean().item(), abs=1e-6)
        assert m["reward/fmt_mean"] == pytest.approx(fmt.mean().item(), abs=1e-6)
        assert m["reward/rm_mean"] == pytest.approx(rm_scores.mean().item(), abs=1e-5)
        assert m["reward/total_mean"] == pytest.approx(total.mean().item(), abs=1e-5)
        assert m["train/reward_mean"] == pytest.approx(total.mean().item(), abs=1e-5)
