"""Build a megatron-core GPTModel from an HF ArchSpec (policy or critic), in the current parallel layout.

    init_model_parallel(Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), seed)
    model, spec = build_and_load("/path/to/hf_dir")            # the HF weights, sharded for this rank

Choices (each one is what makes megarl's logprobs equal HF transformers'):
- Layer spec: Transformer Engine (`get_gpt_decoder_block_spec(use_transformer_engine=True)`, grouped-GEMM experts)
  when CUDA is available and transformer_engine imports; megatron's local spec otherwise (CPU). The bridge maps both
  naming schemes. dtype: float32 on CPU, bfloat16 on GPU, unless given.
- RMSNorm, SwiGLU (gated_linear_unit + silu), no linear biases except Qwen2's q/k/v bias, QK RMSNorm for Qwen3,
  dropout 0, rope with the checkpoint's theta. Llama-3 rope scaling uses megatron's own `_apply_scaling` with all four
  HF parameters (megatron's constructor hard-codes three of them); "linear" scaling uses
  seq_len_interpolation_factor; other rope types are refused by megarl.bridge.hf_config.
- Vocab padded to a multiple of lcm(vocab_pad_multiple, TP) (the padding rows are zero and are masked out of the
  softmax by megarl.megatron.forward).
- MoE: softmax router; top-k renormalised (Mixtral, Qwen*-MoE norm_topk_prob=true) = megatron's default top-k then
  softmax; not renormalised (norm_topk_prob=false) = moe_router_pre_softmax. No aux loss, no token dropping
  (capacity factor None), allgather dispatcher by default. Sequence parallel is switched on for MoE with TP>1
  (megatron requires it). Qwen2-MoE shared experts: moe_shared_expert_intermediate_size + moe_shared_expert_gate
  (sigmoid gate, as HF).
- Critic (value_head=True): the same trunk; `output_layer` is a ValueHead, a replicated [1, hidden] linear (no bias)
  giving one value per token. It is loaded from HF `score.weight` when the checkpoint has one (a *ForSequenceClassification
  reward/value model); otherwise initialised N(0, std=1/(hidden_size+1)) from a generator seeded with `head_seed`
  (identical on every rank), so initial values are small but the trunk receives gradients from the first step.
"""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megarl.bridge.hf_config import ArchSpec, check_layout, load_spec
from megarl.bridge.mapping import LM_HEAD, VALUE_HEAD, padded_vocab_size

DEFAULT_VOCAB_PAD_MULTIPLE = 128


def te_available() -> bool:
    """Transformer Engine layer specs are used when CUDA is available and transformer_engine imports."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def transformer_config(spec: ArchSpec, dtype: Optional[torch.dtype] = None, use_te: Optional[bool] = None,
                       sequence_parallel: Optional[bool] = None, moe_dispatcher: str = "allgather", **overrides):
    """The megatron TransformerConfig for `spec` in the current parallel layout (after init_model_parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = dtype or default_dtype()
    use_te = te_available() if use_te is None else use_te
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    from megarl.megatron.parallel import uneven_stages

    stages = uneven_stages() if pp > 1 else {}
    check_layout(spec, tp, pp, ep, etp, stages.get("num_layers_in_first_pipeline_stage"),
                 stages.get("num_layers_in_last_pipeline_stage"))
    if sequence_parallel is None:
        sequence_parallel = spec.is_moe and tp > 1
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, **stages,
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_pre_softmax=not spec.moe_norm_topk_prob, moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=None,
            moe_token_dispatcher_type=moe_dispatcher, moe_grouped_gemm=bool(use_te),
            moe_layer_freq=[int(m) for m in spec.moe_layers],
        )
        if spec.shared_expert_ffn_hidden_size:
            kw.update(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=spec.shared_expert_gate)
        if spec.router is not None:  # DeepSeek-V3 / GLM-4.5: see megarl.bridge.hf_config.SIGMOID_ROUTER_FAMILIES
            r = spec.router
            kw.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                      moe_router_enable_expert_bias=r.expert_bias, moe_router_bias_update_rate=0.0,
                      moe_router_topk_scaling_factor=r.scaling_factor if r.scaling_factor != 1.0 else None,
                      moe_router_num_groups=r.num_groups if r.num_groups > 1 else None,
                      moe_router_group_topk=r.group_topk if r.num_groups > 1 else None)
    if spec.mla is None:
        kw.update(overrides)
        return TransformerConfig(**kw)
    mla, rope = spec.mla, spec.rope
    # qk_layernorm builds MLA's q/kv latent norms (q_a_layernorm, kv_a_layernorm)
    kw.update(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=mla.q_lora_rank,
              kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
              v_head_dim=mla.v_head_dim, kv_channels=mla.q_head_dim, rotary_base=rope.theta,
              rope_type="yarn" if rope.type == "yarn" else "rope", rotary_scaling_factor=rope.factor,
              original_max_position_embeddings=rope.original_max_position_embeddings, beta_fast=rope.beta_fast,
              beta_slow=rope.beta_slow, mscale=rope.mscale, mscale_all_dim=rope.mscale_all_dim)
    kw.update(overrides)
    return MLATransformerConfig(**kw)


def _mla_column_parallel_down_projections(block_spec, use_te: bool) -> None:
    """megatron-core's TE MLA spec replicates the q/kv down projections (TELinear 'duplicated'); its local spec
    column-splits them. megarl uses the column split on both, so one mapping (megarl.bridge.mapping) serves both.
    Without TE the core attention is megarl's MLADotProductAttention (the local one cannot take MLA's head sizes)."""
    if not use_te:
        from megarl.megatron.mla_attention import use_local_mla_core_attention

        use_local_mla_core_attention(block_spec)
        return
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    for layer in block_spec.layer_specs:
        sub = layer.submodules.self_attention.submodules
        sub.linear_q_down_proj = TEColumnParallelLinear
        sub.linear_kv_down_proj = TEColumnParallelLinear


@contextlib.contextmanager
def _tensor_cuda_is_identity_on_cpu():
    """megatron-core 0.16.1 LanguageModule.setup_embeddings_and_output_layer calls `weight.data.cuda()` before the
    all-reduce that copies tied embeddings to the last pipeline stage; without CUDA that is a no-op here."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


class ValueHead(torch.nn.Module):
    """Critic head: one value per token, `values = hidden @ weight.T`, weight [1, hidden], replicated on TP ranks.

    Called by GPTModel in place of its output layer: takes [s, b, h] (sequence-parallel shards gathered first) and
    returns ([s, b, 1], None); GPTModel.forward then returns [b, s, 1] when no labels are given."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=g) / (hidden_size + 1)
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every TP rank computes the same values on the full sequence: the backward keeps this rank's chunk
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


def build_gpt_model(spec: ArchSpec, *, value_head: bool = False, dtype: Optional[torch.dtype] = None,
                    use_te: Optional[bool] = None, vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE,
                    sequence_parallel: Optional[bool] = None, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, vp_stage: Optional[int] = None,
                    moe_dispatcher: str = "allgather", head_seed: int = 0, **config_overrides):
    """A GPTModel for this rank's pipeline stage (weights randomly initialised; see load_hf_weights / build_and_load).

    The model carries `megarl_spec` (the ArchSpec) and `megarl_head` ("lm" or "value") for the bridge and forward.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = te_available() if use_te is None else use_te
    config = transformer_config(spec, dtype=dtype, use_te=use_te, sequence_parallel=sequence_parallel,
                                moe_dispatcher=moe_dispatcher, **config_overrides)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                            vp_stage=vp_stage)
    if spec.mla is not None:
        _mla_column_parallel_down_projections(block_spec, use_te)
    rope = spec.rope
    with _tensor_cuda_is_identity_on_cpu():
        model = GPTModel(
            config=config, transformer_layer_spec=block_spec,
            vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size, vocab_pad_multiple),
            max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
            position_embedding_type="rope", rotary_percent=rope.partial, rotary_base=rope.theta,
            rope_scaling=rope.type == "llama3", rope_scaling_factor=rope.factor if rope.type == "llama3" else 8.0,
            seq_len_interpolation_factor=rope.factor if rope.type == "linear" else None, vp_stage=vp_stage,
        )
    if rope.type == "llama3":  # megatron's constructor fixes low/high freq factors and the original context
        emb = model.rotary_pos_emb
        dim = spec.head_dim
        base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=emb.inv_freq.device) / dim))
        emb.inv_freq = emb._apply_scaling(base, factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                                          high_freq_factor=rope.high_freq_factor,
                                          original_max_position_embeddings=rope.original_max_position_embeddings)
    if value_head and post_process:
        model.output_layer = ValueHead(spec.hidden_size, config.sequence_parallel, config.params_dtype, head_seed)
        if torch.cuda.is_available():
            model.output_layer.cuda()
    model.megarl_spec = spec
    model.megarl_head = VALUE_HEAD if value_head else LM_HEAD
    return model


def build_and_load(hf_dir: Union[str, Path], *, value_head: bool = False, strict: bool = True, **build_kwargs):
    """Read config.json, build this rank's model and load the HF weights into it. Returns (model, spec).

    Call on every rank after init_model_parallel; each rank reads only its own slices of the safetensors files."""
    from megarl.bridge.importer import load_hf_weights

    spec = load_spec(hf_dir)
    model = build_gpt_model(spec, value_head=value_head, **build_kwargs)
    if torch.cuda.is_available():
        model.cuda()
    report = load_hf_weights(model, hf_dir, spec, strict=strict)
    model.megarl_load_report = report
    return model, spec
