"""`megarl plan` for DeepSeek-V3 671B (recipes/grpo_deepseek_v3_671b.yaml on 64 trainer + 8 Ray engine nodes x 8 B200
179 GiB), checked against a hand calculation from the published config: MLA's latent KV cache, uneven pipeline stages,
the expert layout."""
import re
from pathlib import Path

from megarl.plan import plan_recipe
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3


def test_deepseek_v3_671b_fits_and_matches_hand_calculation():
    cfg = load_config(ROOT / "recipes" / "grpo_deepseek_v3_671b.yaml")
    report = plan_recipe(cfg, 72, 8, 179)
    assert report.fits, report.text
    # DeepSeek-V3: h 7168, 61 layers (3 dense), 128 heads, q_lora 1536, kv_lora 512, nope 128 / rope 64 / v 128,
    # 256 experts of 2048 (+1 shared), vocab 129280
    h, heads, ql, kl, nope, rope, v, fe, experts, vocab = 7168, 128, 1536, 512, 128, 64, 128, 2048, 256, 129280
    attn = h * ql + ql * heads * (nope + rope) + h * (kl + rope) + kl * heads * (nope + v) + heads * v * h
    shared, router, expert = 3 * h * fe, experts * h, 3 * h * fe
    # trainer TP1 PP16 EP32 ETP1 on 512 GPUs; stages 1 + 14 x 4 + 4 layers: the last stage holds 4 MoE layers, the
    # LM head, and 256 / 32 = 8 experts per layer
    dp, edp = 512 // 16, 512 // (32 * 16)
    dense = 4 * (attn + shared + router) + vocab * h
    local_experts = 4 * (experts // 32) * expert
    states = (dense + local_experts) * (2 + 4) + dense * 12 / dp + local_experts * 12 / edp
    # megatron's global buffer the allgather dispatcher gathers into, kept from the first forward: one 8,192-token row
    # per micro-batch (TP1, no sequence parallel) gathered over expert TP1 x EP32, h x 2 B each
    kept = 8192 * 32 * h * 2
    hand = (states + kept) * 1.05 + 1 * GIB  # allocator reserve over the trainer's bytes, CUDA context; no engine
    assert abs(report.phases["generate"] - hand) / hand < 0.01, (report.phases["generate"] / GIB, hand / GIB)
    # engine TP8 EP8 (one node: an engine replica must fit in one): 32 experts per MoE layer, the q/kv down projections
    # whole on every rank (vLLM fuses them, replicated), the up/out projections, shared experts, dense MLPs and
    # vocabulary split 8 ways
    shard = (58 * (experts // 8) * expert + 61 * (h * (ql + kl + rope) + router * 58 / 61)
             + (61 * (attn - h * (ql + kl + rope)) + 58 * shared + 3 * 3 * h * 18432 + 2 * vocab * h) / 8) * 2
    assert abs(report.sync_bytes_per_engine_rank - shard) / shard < 0.01, (report.sync_bytes_per_engine_rank, shard)
    # MLA caches the 512 + 64 latent per token and layer (bf16), whole on each rank: no KV heads
    engine = 0.95 * 179 * GIB  # the engine's share of its own GPU
    kv_per_token = 61 * (kl + rope) * 2
    activations = 8192 * 2 * (4 * h + 2 * 8 * fe // 8) + 256 * vocab // 8 * 4
    tokens = int((engine - report.sync_bytes_per_engine_rank - activations) // kv_per_token)
    shown = int(re.search(r"KV cache [\d.]+ GiB = ([\d,]+) tokens", report.text).group(1).replace(",", ""))
    assert abs(shown - tokens) / tokens < 0.01, (shown, tokens)
    # bf16 weights of one TP8 replica do not leave an H200 room for a sequence's KV cache
    assert not plan_recipe(cfg, 72, 8, 141).fits
