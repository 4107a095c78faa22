"""`megarl rm` at TP2 and PP2: a few Bradley-Terry steps on preference pairs, then the exported
*ForSequenceClassification directory scored by HF transformers gives the held-out scores megarl reported (the exported
weights are the trained ones, the last-token rule is HF's)."""
import json

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import score_bound
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.parity


def _pairs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in torch.randint(0, 50, (2,), generator=g))
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                     "chosen": f"The answer is {a + b}.", "rejected": f"I think it is {a + b + 1 + i % 3}, or not."})
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_rm_trains_at_a_layout_and_exports_what_it_scored(tmp_path, tp, pp):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.config import load_unchecked

    base = make_tiny_model("qwen2", tmp_path / "base", seed=2, init_std=0.02)
    for name, rows in (("train", _pairs(32, 1)), ("val", _pairs(8, 2))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_unchecked(None, [f"model.path={base}", f"trainer.run_dir={tmp_path / 'run'}", "model.dtype=float32",
                                f"parallelism.tensor_model_parallel_size={tp}",
                                f"parallelism.pipeline_model_parallel_size={pp}", "trainer.n_gpus_per_node=2",
                                f"rm.train_files=[{tmp_path / 'train.jsonl'}]",
                                f"rm.val_files=[{tmp_path / 'val.jsonl'}]",
                                "rm.batch_size=8", "rm.micro_batch_size_per_gpu=4", "rm.total_steps=3",
                                "rm.optim.lr=1e-3", "logging.tensorboard=false",
                                # the centring term on one layout: its plumbing, its metric (the loss: unit test)
                                f"rm.center_rewards_coefficient={0.1 if pp == 2 else 0.0}"])
    run_ranks("megarl.rm:rm_entry", 2, {"cfg_dict": cfg.model_dump()}, timeout=900)

    out = tmp_path / "run" / "rm_model"
    metrics = [json.loads(line) for line in (tmp_path / "run" / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics][0] == 0 and metrics[-1]["step"] == 3
    assert all(m["rm/lr"] > 0 and m["rm/loss"] > 0 for m in metrics if "rm/loss" in m)
    final = metrics[-1]
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    chosen, rejected, longest = [], [], 0
    for row in _pairs(8, 2):
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for text, into in ((row["chosen"], chosen), (row["rejected"], rejected)):
            ids = tok(prompt + text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            longest = max(longest, len(ids))
            with torch.no_grad():
                into.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    chosen, rejected = torch.tensor(chosen), torch.tensor(rejected)
    # a mean of scores differs by at most the largest score difference: the derived bound over the 16 scores
    tol = score_bound(out, torch.cat([chosen, rejected]), longest)
    print(f"[measured] val means: chosen {abs(final['rm/val_chosen_mean'] - chosen.mean().item()):.2e}, rejected "
          f"{abs(final['rm/val_rejected_mean'] - rejected.mean().item()):.2e} (bound {tol:.2e})")
    assert final["rm/val_chosen_mean"] == pytest.approx(chosen.mean().item(), abs=tol)
    assert final["rm/val_rejected_mean"] == pytest.approx(rejected.mean().item(), abs=tol)
    assert final["rm/val_accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    # a verifier at 0: chosen sides above, rejected below, by HF's scores; a side within the bound of 0 may fall
    # either way in megarl's, so each such side widens the allowance by one in 16
    sides = torch.cat([chosen, rejected])
    want = torch.cat([chosen > 0, rejected < 0]).float().mean().item()
    assert abs(final["rm/val_sign_accuracy"] - want) <= (sides.abs() <= tol).sum().item() / 16 + 1e-6
    assert all("rm/center" in m for m in metrics if "rm/loss" in m)
    assert metrics[0]["rm/val_chosen_mean"] != pytest.approx(final["rm/val_chosen_mean"], abs=1e-4)  # it trained
