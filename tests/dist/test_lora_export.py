"""A LoRA actor's checkpoint -> `megarl merge --lora adapter` (a PEFT directory) and `--lora merged` (HF weights).

The saving ranks (TP2) load a PEFT adapter onto a tiny model, take one PPO step (so the adapters differ from the
file), save through megarl's Checkpointer and return their logprobs and the adapters. Then, in the test process:
- the PEFT directory loads with peft.PeftModel.from_pretrained and gives megarl's logprobs (float32, within the
  derived bound of tests/helpers/bounds.py: a pure forward of the same weights), and
  its tensors are the trained adapters;
- every merged HF weight equals base + scaling * (B @ A) in float32 within the GEMM's rounding (A, B from the PEFT
  directory; the last bits follow the CPU's kernels), and
  every weight without an adapter equals the base bitwise.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_merge import _batch
from tests.helpers.bounds import logits_bound, lora_merge_bound
from tests.helpers.tiny_models import make_peft_adapter, make_tiny_model, read_checkpoint

pytestmark = pytest.mark.parity
TARGETS = ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj")


def save_lora_rank(hf_dir, adapter_dir, run_dir, batch, tp):
    import torch.distributed as dist

    from megarl.checkpoint.state import Checkpointer
    from megarl.config import MegarlConfig
    from megarl.config.schema import OptimConfig
    from megarl.lora.layers import apply_lora, gather_adapters, load_adapters
    from megarl.lora.peft_io import read_adapter, settings_from_peft
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from megarl.runtime import Runtime

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    world, rank = dist.get_world_size(), dist.get_rank()
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    settings = settings_from_peft(adapter_dir)
    apply_lora(model, spec, settings)
    load_adapters(model, read_adapter(adapter_dir))
    actor = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=10)
    cfg = MegarlConfig.model_validate({
        "model": {"path": str(hf_dir)},
        "trainer": {"run_dir": str(run_dir), "n_gpus_per_node": world, "total_steps": 10},
        "parallelism": {"tensor_model_parallel_size": tp},
        "actor": {"lora": {"rank": settings.rank, "alpha": settings.alpha, "target_modules": list(TARGETS)}},
        "checkpoint": {"save_on_sigterm": False}})
    rt = Runtime(rank=rank, world_size=world, dp_rank=0, dp_size=1, run_dir=run_dir)
    loss = PolicyLossSettings(vocab_size=spec.vocab_size)
    denominator = loss_denominator([batch["response_mask"]], "token-mean")
    train_mini_batch(actor, [batch], PolicyLoss(loss, denominator))
    Checkpointer(cfg, rt, models={"actor": actor}, states={}).save(1)
    return {"logprobs": token_logprobs(actor.chunks, batch["input_ids"], micro_batch_size=4),
            "adapters": gather_adapters(actor.chunks)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-export")
    hf_dir = make_tiny_model("llama", root / "llama")  # untied head, Llama-3 rope scaling
    adapter = make_peft_adapter(hf_dir, root / "adapter", target_modules=TARGETS, rank=8, alpha=16)
    batch = _batch(hf_dir)
    run_dir = root / "run"
    results = run_ranks(f"{__name__}:save_lora_rank", 2, {"hf_dir": str(hf_dir), "adapter_dir": str(adapter),
                                                           "run_dir": run_dir, "batch": batch, "tp": 2}, timeout=600)
    trained = results[0]
    before = read_adapter_file(adapter)
    assert any(not torch.equal(trained["adapters"][k], before[k]) for k in before)  # the step moved the adapters
    return hf_dir, batch, run_dir, trained


def read_adapter_file(d):
    from peft.utils import load_peft_weights

    return load_peft_weights(str(d), device="cpu")


@pytest.mark.parity_repeat  # the AVX2 tier keeps the merged-weights test (the same saved run)
def test_merge_writes_a_peft_adapter_directory(saved, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.merge_cli import main

    hf_dir, batch, run_dir, trained = saved
    out = tmp_path / "adapter"
    assert main(["--ckpt", str(run_dir), "--out", str(out), "--lora", "adapter", "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    written = read_adapter_file(out)
    assert set(written) == set(trained["adapters"])
    for k, v in written.items():
        assert torch.equal(v, trained["adapters"][k]), k
    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["input_ids"][:, 1:] != 0
    diff = (lp - trained["logprobs"]).abs()[mask].max().item()
    tol = logits_bound(hf_dir, logits[:, :-1], mask)  # the adapted model's logits
    print(f"[measured] PEFT on the merged adapter vs megarl {diff:.2e} (bound {tol:.2e})")
    assert diff <= tol, (diff, tol)


def test_merge_writes_merged_weights(saved, tmp_path):
    from megarl.checkpoint.merge_cli import main

    hf_dir, _, run_dir, trained = saved
    out = tmp_path / "merged"
    assert main(["--ckpt", str(run_dir), "--out", str(out), "--no-progress"]) == 0
    merged, base = read_checkpoint(out), read_checkpoint(hf_dir)
    assert set(merged) == set(base)
    scaling = 16 / 8
    adapted = 0
    for name, w in base.items():
        stem = "base_model.model." + name[: -len(".weight")]
        if stem + ".lora_A.weight" in trained["adapters"]:
            a, b = trained["adapters"][stem + ".lora_A.weight"], trained["adapters"][stem + ".lora_B.weight"]
            # the GEMM's bits depend on the CPU's kernels (AVX2 and AVX-512 MKL block the rank-r sum differently)
            expected = w + scaling * (b @ a)
            excess = (merged[name].double() - expected.double()).abs() - lora_merge_bound(w, a, b, scaling)
            assert excess.max() <= 0, (name, excess.max().item())
            adapted += 1
        else:
            assert torch.equal(merged[name], w), name
    assert adapted == 4 * len(TARGETS)
