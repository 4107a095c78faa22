"""actor.lora.sync: adapter end to end: megarl's adapters (loaded from a PEFT directory onto megatron's linears) go
to a vLLM engine started with its LoRA support, as the trainer's sync sends them (the engine starts with dummy
weights: the base through the ordinary sync once, then only the adapters), and vLLM's logprobs equal HF transformers
+ PEFT with that adapter (the independent reference). The bytes sent are the adapters' size, counted by hand."""
import pytest
import torch

from megarl.launch_local import run_ranks
from megarl.hf_reference import hf_logprobs
from megarl.verify import make_batch
from tests.helpers.tiny_models import VOCAB, make_peft_adapter, make_tiny_model

TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")  # fused qkv and gate/up partly adapted
RANK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapter-sync")
    hf_dir = make_tiny_model("llama", root / "llama")
    adapter = make_peft_adapter(hf_dir, root / "adapter", rank=RANK, alpha=16.0, target_modules=TARGETS, scale=0.1)
    tokens, lengths, _ = make_batch(str(hf_dir), VOCAB, 4, 48)
    with_adapter = hf_logprobs(str(hf_dir), tokens, lengths=None, lora=str(adapter))
    base = hf_logprobs(str(hf_dir), tokens)
    return hf_dir, adapter, tokens, lengths, with_adapter, base


def _max_real_diff(a: torch.Tensor, rows: list, lengths: torch.Tensor) -> float:
    return max((torch.tensor(row) - a[i, : n - 1]).abs().max().item() for i, (row, n) in enumerate(zip(rows, lengths)))


@pytest.mark.parametrize("engine_tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["engine-tp1", "engine-tp2"])
def test_adapter_sync_gives_hf_peft_logprobs_and_sends_only_the_adapters(model, engine_tp):
    hf_dir, adapter, tokens, lengths, with_adapter, base = model
    results = run_ranks("megarl.verify:_rank_body", engine_tp,
                        dict(hf_dir=str(hf_dir), tokens=tokens, lengths=lengths, engine="vllm", engine_tp=engine_tp,
                             lora=str(adapter), lora_sync="adapter"), timeout=900)
    engine = next(r for r in results if "vllm" in r)
    # the adapter changes the logprobs by far more than the tolerance: the engine really runs it
    assert _max_real_diff(base, engine["vllm"], lengths) > 0.05
    from tests.helpers.bounds import verify_bound

    tol = verify_bound(hf_dir, 48, 4, lora=str(adapter))  # HF + PEFT's logits on the batch above
    print(f"[measured] adapter sync: vLLM vs HF+PEFT {_max_real_diff(with_adapter, engine['vllm'], lengths):.2e} "
          f"(bound {tol:.2e})")
    assert _max_real_diff(with_adapter, engine["vllm"], lengths) < tol
    sync = engine["sync"]
    # tiny llama: hidden 128, ffn 256, 4 layers, 2 KV heads of 32 (k/v out 64); rank 8, float32:
    # per layer q 8*(128+128) + v 8*(128+64) + o 8*(128+128) + up 8*(128+256) + down 8*(256+128) = 11,776
    assert sync["sync/bytes"] == 4 * 11776 * 4 == 188416
    from safetensors.torch import load_file

    peft_tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert sync["sync/bytes"] == sum(t.numel() * 4 for t in peft_tensors.values())
    assert sync["weight_sync/num_tensors"] == len(peft_tensors) == 4 * 5 * 2
    # every worker read the whole adapters (vLLM slices them for its TP rank)
    assert sync["weight_sync/engine_bytes"] == engine_tp * 188416
