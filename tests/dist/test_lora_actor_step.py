"""One PPO update of a LoRA actor equals the same update done with plain torch + PEFT.

The reference: PEFT's adapters on the HF model (loaded from the same PEFT directory, A and B random and non-zero),
megarl.algo's PPO loss over the whole batch, torch autograd and torch.optim.Adam over the adapter parameters only. The
megatron side splits the batch over micro-batches and DP ranks and the adapters over TP/PP ranks; the base stays
frozen (no gradient buffer, no optimizer state) and is checked to be unchanged.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_actor_step import CLIP_HIGH, CLIP_LOW, LR, N, _batch
from tests.helpers.tiny_models import make_peft_adapter, make_tiny_model

pytestmark = pytest.mark.parity
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def lora_actor_rank(hf_dir, adapter_dir, batch, tp, pp):
    from megatron.core import parallel_state as ps

    from megarl.bridge.exporter import export_to_dict
    from megarl.config.schema import OptimConfig
    from megarl.lora.layers import adapters_disabled, apply_lora, gather_adapters, load_adapters
    from megarl.lora.peft_io import read_adapter, settings_from_peft
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    model, spec = build_and_load(hf_dir)
    apply_lora(model, spec, settings_from_peft(adapter_dir))
    load_adapters(model, read_adapter(adapter_dir))
    trainable = make_trainable(model, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0), total_steps=10)
    # frozen base: only adapters have gradient buffers and optimizer states
    trained = [p for g in trainable.optimizer.param_groups for p in g["params"]]
    assert trained and all(getattr(p, "megarl_lora", False) for p in trained)
    assert all(p.requires_grad == bool(getattr(p, "megarl_lora", False)) for p in trainable.chunks[0].parameters())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = N // dp
    mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
    micro = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(per_rank)]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    metrics = train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
    with adapters_disabled(trainable.chunks):
        base_after = export_to_dict(trainable.chunks, spec, dst_rank=0)
    adapters = gather_adapters(trainable.chunks)
    import torch.distributed as dist

    return {"metrics": metrics, "adapters": adapters, "base": base_after if dist.get_rank() == 0 else None}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl import algo
    from tests.helpers.tiny_models import read_checkpoint

    root = tmp_path_factory.mktemp("lora-step")
    hf_dir = make_tiny_model("qwen2", root / "qwen2")  # tied embeddings, QKV bias
    adapter = make_peft_adapter(hf_dir, root / "adapter", target_modules=TARGETS, scale=0.1)
    batch = _batch(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    logits = model(input_ids=batch["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    loss, _ = algo.ppo_clip_loss(batch["old_log_probs"], lp, batch["advantages"], batch["response_mask"],
                                 "token-mean", CLIP_LOW, CLIP_HIGH, 3.0)
    loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert params and all("lora_" in n for n in params)
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values()))
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    torch.optim.Adam(params.values(), lr=LR, betas=(0.9, 0.999), eps=1e-8).step()
    # PEFT names parameters with the adapter name ("...lora_A.default.weight"); the saved format drops it
    after = {n.replace(".default", ""): p.detach().clone() for n, p in params.items()}
    grads = {n.replace(".default", ""): g for n, g in grads.items()}
    return hf_dir, adapter, batch, {"loss": loss.item(), "grad_norm": grad_norm.item(), "adapters": after,
                                    "grads": grads, "base": read_checkpoint(hf_dir)}


@pytest.mark.parametrize("tp,pp,dp", [
    (2, 1, 1), pytest.param(1, 2, 1, marks=pytest.mark.slow), pytest.param(1, 1, 2, marks=pytest.mark.slow)],
    ids=["tp2", "pp2", "dp2"])
def test_lora_update_equals_peft_reference(setup, tp, pp, dp):
    hf_dir, adapter, batch, ref = setup
    results = run_ranks(f"{__name__}:lora_actor_rank", tp * pp * dp,
                        {"hf_dir": str(hf_dir), "adapter_dir": str(adapter), "batch": batch, "tp": tp, "pp": pp},
                        timeout=300)
    for r in results:
        m = r["metrics"]
        print(f"[measured] pg_loss {abs(m['pg_loss'] - ref['loss']):.2e} grad_norm rel "
              f"{abs(m['grad_norm'] - ref['grad_norm']) / max(1.0, ref['grad_norm']):.2e}")
        assert abs(m["pg_loss"] - ref["loss"]) < 1e-5, (m, ref["loss"])
        assert abs(m["grad_norm"] - ref["grad_norm"]) < 1e-4 * max(1.0, ref["grad_norm"]), (m, ref["grad_norm"])
    got = results[0]["adapters"]
    assert set(got) == set(ref["adapters"]), set(got) ^ set(ref["adapters"])
    worst = 0.0
    for k, want in ref["adapters"].items():
        diff = (got[k] - want).abs()
        # Adam's first step is sign-like where |g| ~ eps (see test_actor_step): exact only where |g| >> eps
        conditioned = ref["grads"][k].abs() > 1e-5
        assert diff.max().item() <= 2 * LR, k
        assert conditioned.float().mean() > 0.5, k
        worst = max(worst, diff[conditioned].max().item())
        assert diff[conditioned].max().item() < 2e-5, (k, diff[conditioned].max().item())
    print(f"[measured] adapters where |g| > 1e-5: {worst:.2e}")
    for k, v in results[0]["base"].items():  # the frozen base did not move
        assert torch.equal(v, ref["base"][k]), k
