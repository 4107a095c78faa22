"""Tiny random Hugging Face models and a local tokenizer, for tests and demos (no model hub needed).

    from tests.helpers.tiny_models import make_tiny_model, hf_logprobs
    path = make_tiny_model("qwen2", tmp_path / "qwen2")        # config.json, sharded safetensors + index, tokenizer
    ref = hf_logprobs(path, tokens)                            # [N, S-1] float32, transformers eager attention

Every architecture megarl's bridge supports has a preset in TINY_PRESETS; the presets differ on purpose so that the
bridge's special cases are all exercised: GQA, explicit head_dim != hidden/heads (qwen3, qwen3_moe), tied and untied
embeddings, QKV bias (qwen2, qwen2_moe), QK norm (qwen3*), Llama-3 rope scaling with non-default parameters (llama),
an odd vocab size (301: padding), shared experts with a dense layer in between (qwen2_moe). All have head_dim 32
(vLLM's CPU attention needs >= 32) and 4 layers (PP=2). Weights are N(0, init_std) with random norm weights and
biases, so a swapped or mis-sliced tensor changes the logprobs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 301  # odd: exercises megatron's vocab padding at any TP
TOKENIZER_VOCAB = 290  # <= VOCAB; byte-level BPE: 256 bytes + 3 specials + merges
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.",
          "Reinforcement learning with verifiable rewards: 1+1=2, 2*3=6, 12-5=7.",
          "user assistant system answer question reasoning think step by step",
          "Megatron shards the model; vLLM generates rollouts; the trainer updates the policy."]

_COMMON = dict(vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=512, rms_norm_eps=1e-6,
               hidden_act="silu")
TINY_PRESETS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=False, sliding_window=4096)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, router_jitter_noise=0.0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)),
    # DeepSeek-V3 (MLA): q LoRA, YaRN rope (interleaved in the checkpoint), 8 experts in 4 groups (top-2 groups,
    # top-4 experts), a shared expert, routed_scaling_factor, one dense first layer. The latent sizes are
    # DeepSeek-V3's own (kv_lora_rank 512 + rope 64): vLLM's CPU MLA kernel is compiled for that cache width only.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=1, tie_word_embeddings=False, max_position_embeddings=256,
        topk_method="noaux_tc", scoring_func="sigmoid",  # as in DeepSeek-V3's config.json; vLLM reads them
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # DeepSeek-V3 without q LoRA (DeepSeek-V2-Lite / Moonlight style q_proj), plain rope, no expert groups,
    # two dense first layers.
    "deepseek_v3_noqlora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, first_k_dense_replace=2, tie_word_embeddings=False, rope_theta=50000.0,
        topk_method="noaux_tc", scoring_func="sigmoid")),
    # GLM-4.5: partial rotary (half of head_dim), q/k/v bias, QK norm, sigmoid router with bias, shared expert,
    # one dense first layer.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.5, first_k_dense_replace=1, tie_word_embeddings=False, rope_theta=1000000.0)),
}
DENSE_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
ARCHS = DENSE_ARCHS + MOE_ARCHS
# DeepSeek-V3 / GLM-4.5 shapes (own tests: tests/dist/test_bridge_deepseek.py)
SIGMOID_MOE_ARCHS = ("deepseek_v3", "deepseek_v3_noqlora", "glm4_moe")


def make_tokenizer(out_dir: Union[str, Path, None] = None, vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE tokenizer trained on a few sentences, as a PreTrainedTokenizerFast with a chat template.

    Saved to out_dir when given (then `AutoTokenizer.from_pretrained(out_dir)` works). eos = pad = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     bos_token=None, unk_token=None)
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def tiny_config(arch: str, **overrides):
    """The transformers config of a preset (overrides replace preset fields)."""
    import transformers

    if arch not in TINY_PRESETS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(TINY_PRESETS)}")
    config_cls, _, fields = TINY_PRESETS[arch]
    kw = dict(_COMMON, **fields)
    kw.update(overrides)
    kw.setdefault("eos_token_id", 0)
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("bos_token_id", 0)
    return getattr(transformers, config_cls)(**kw)


def randomize_(model, init_std: float = 0.1, seed: int = 0) -> None:
    """Re-initialise every parameter: matrices N(0, init_std), norm weights 1 + N(0, 0.1), biases N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek/GLM router bias: changes which experts are chosen
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_tiny_model(arch: str, out_dir: Union[str, Path], *, seed: int = 0, init_std: float = 0.1,
                    max_shard_size: Optional[str] = "200KB", tokenizer: bool = True, head: str = "lm",
                    **config_overrides) -> Path:
    """Create a random tiny HF model of `arch` in out_dir (float32 safetensors, sharded with an index when the model
    is bigger than max_shard_size; None: one file) plus a tokenizer. head="value" saves the *ForSequenceClassification
    variant with num_labels=1 (a reward/value model with `score.weight`). Returns the directory."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    _, model_cls, _ = TINY_PRESETS[arch]
    if head == "value":
        model_cls = model_cls.replace("ForCausalLM", "ForSequenceClassification")
        config.num_labels = 1
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    randomize_(model, init_std, seed)
    if config.tie_word_embeddings and head == "lm":
        model.tie_weights()
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    if tokenizer:
        make_tokenizer(out)
    return out


def sample_tokens(n: int = 3, seq_len: int = 24, vocab_size: int = VOCAB, seed: int = 0,
                  pad_id: int = 0, min_len: Optional[int] = None):
    """Random token ids [n, seq_len] right-padded with pad_id to varying lengths, and the lengths [n]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab_size, (n, seq_len), generator=g)
    lo = min_len or max(2, seq_len // 2)
    lengths = torch.randint(lo, seq_len + 1, (n,), generator=g)
    lengths[0] = seq_len
    for i, length in enumerate(lengths.tolist()):
        tokens[i, length:] = pad_id
    return tokens, lengths


def hf_logprobs(hf_dir: Union[str, Path], tokens, model=None):
    """Reference per-token logprobs [N, S-1] from HF transformers (float32, eager attention, causal, no padding mask:
    right padding does not affect real tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                     attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def hf_values(hf_dir: Union[str, Path], tokens):
    """Per-token values [N, S] of a *ForSequenceClassification (num_labels=1) model: its score head on every token."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                               attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        hidden = model.model(input_ids=tokens).last_hidden_state
        return model.score(hidden).squeeze(-1).float()


def read_checkpoint(hf_dir: Union[str, Path]) -> dict:
    """Every tensor of an HF directory's safetensors files, {name: tensor}."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def make_peft_adapter(hf_dir: Union[str, Path], out_dir: Union[str, Path], *, rank: int = 4, alpha: float = 8.0,
                      target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      seed: int = 0, scale: float = 0.05) -> Path:
    """A PEFT LoRA adapter for the model in hf_dir, made and saved by PEFT itself, with random non-zero A and B
    (entries N(0, scale)) so that every adapter changes the logprobs. Returns out_dir."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                                                  lora_dropout=0.0, init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)
