"""Build a megatron-core GPTModel from an HF ArchSpec (policy or critic), in the current parallel layout.

    init_model_parallel(Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), seed)
    model, spec = build_and_load("/path/to/hf_dir")            # the HF weights, sharded for this rank

Choices (each one is what makes megarl's logprobs equal HF transformers'):
- Layer spec: Transformer Engine (`get_gpt_decoder_block_spec(use_transformer_engine=True)`, grouped-GEMM experts)
  when CUDA is available and transformer_engine imports; otherwise megatron's local spec with megarl's RMSNorm (in
  params_dtype) and core attention through torch's scaled_dot_product_attention (megarl.megatron.layer_spec). The
  bridge maps both naming schemes. dtype: float32 on CPU, bfloat16 on GPU, unless given; every parameter is in it.
- Fusions (`fusions="auto"`): rope fusion (TE's kernel), SwiGLU fusion (megatron's fused bias-SwiGLU, CUDA) and
  gradient-accumulation fusion (TE layers add weight gradients into megatron's fp32 main_grad buffers) each on when
  its kernel is there, off with the reason logged and kept in `model.megarl_fusions` otherwise.
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
- Vision-language (Qwen2.5-VL, Qwen3-VL dense; spec.vision set): position_embedding_type "mrope" with the checkpoint's
  mrope_section (Qwen3-VL's interleaved: megarl.megatron.vlm.InterleavedMRoPE in place of megatron's contiguous
  sections), and megarl.megatron.vlm's vision tower attached to the first stage's GPTModel as `vision_model`
  (replicated over TP).
- Critic (value_head=True): the same trunk; `output_layer` is a ValueHead, a replicated [1, hidden] linear (no bias)
  giving one value per token. It is loaded from HF `score.weight` when the checkpoint has one (a *ForSequenceClassification
  reward/value model); otherwise initialised N(0, std=1/(hidden_size+1)) from a generator seeded with `head_seed`
  (identical on every rank), so initial values are small but the trunk receives gradients from the first step.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megarl.bridge.hf_config import ArchSpec, check_layout, load_spec
from megarl.bridge.mapping import LM_HEAD, VALUE_HEAD, VISION_PREFIX, padded_vocab_size

DEFAULT_VOCAB_PAD_MULTIPLE = 128


def te_available() -> bool:
    """Transformer Engine layer specs are used when CUDA is available and transformer_engine imports, unless the
    environment says MEGARL_USE_TE=0 (`make test-gpu TE=0` and the benchmarks' no-TE rows: the path without TE on a
    machine that has it)."""
    from megarl.megatron.te_guard import te_import_failure

    if os.environ.get("MEGARL_USE_TE") == "0":
        return False
    if te_import_failure() is not None:  # logged once by te_guard with the reason
        return False
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "gradient_accumulation_fusion")


def fusion_settings(use_te: bool, enabled: bool = True) -> dict:
    """{TransformerConfig fusion field: (on, reason)} for this machine: on where its kernel is there.

    enabled=False (model.fusions=false) turns every fusion off."""
    if not enabled:
        return {name: (False, "model.fusions=false") for name in FUSIONS}
    cuda = torch.cuda.is_available()
    out = {}
    if not use_te:
        out["apply_rope_fusion"] = (False, "needs Transformer Engine's fused rope kernel (not in this spec)")
    else:
        from megatron.core.models.common.embeddings import rope_utils

        kernel = getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None
        out["apply_rope_fusion"] = (kernel, "Transformer Engine's fused rope" if kernel
                                    else "this Transformer Engine build has no fused rope kernel")
    out["bias_activation_fusion"] = ((True, "megatron's fused SwiGLU (torch.compile'd on CUDA)") if cuda
                                     else (False, "no CUDA: the fused SwiGLU kernel only pays off on a GPU"))
    if use_te:
        out["gradient_accumulation_fusion"] = (True, "Transformer Engine layers accumulate weight gradients into the "
                                               "fp32 main_grad buffers")
    else:
        from megatron.core.tensor_parallel import layers

        apex = bool(getattr(layers, "_grad_accum_fusion_available", False)) and cuda
        out["gradient_accumulation_fusion"] = (apex, "apex's fused_weight_gradient_mlp_cuda" if apex else
                                               "needs Transformer Engine layers (or apex's fused_weight_gradient_mlp"
                                               "_cuda)")
    return out


def default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def transformer_config(spec: ArchSpec, dtype: Optional[torch.dtype] = None, use_te: Optional[bool] = None,
                       sequence_parallel: Optional[bool] = None, moe_dispatcher: str = "allgather",
                       fusions: Union[str, bool] = False, **overrides):
    """The megatron TransformerConfig for `spec` in the current parallel layout (after init_model_parallel).

    fusions: "auto" (or True) turns on each fusion of `fusion_settings` whose kernel is there; False none (the
    default here, for callers that build configs for comparisons; build_gpt_model passes its own)."""
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
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=ps.get_context_parallel_world_size(),
        # megatron computes each chunk's layer offset from it (and the interleaved schedule's micro-batch groups)
        virtual_pipeline_model_parallel_size=vpp,
        expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
        masked_softmax_fusion=False, persist_layer_norm=False,
        **{name: on for name, (on, _) in fusion_settings(use_te, fusions not in (False, "off")).items()}, **stages,
    )
    if vpp is not None:
        # Interleaved 1F1B exchanges activations and gradients with both pipeline neighbours at once; at PP2 they are
        # the same rank. Batched p2p (one batch_isend_irecv, same tag) then pairs a gradient with an activation receive
        # (seen on gloo: micro-batches after the first group computed on the wrong inputs). Megatron-LM runs VPP with
        # overlap_p2p_comm=True and batch_p2p_comm=False: separate, ordered sends and receives per direction. megarl
        # does the same; on CPU without the overlap (no streams to overlap on).
        kw.update(batch_p2p_comm=False, overlap_p2p_comm=torch.cuda.is_available())
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
    if spec.rope.mrope_section:  # M-RoPE (vision-language models): megatron's MultimodalRotaryEmbedding
        kw.update(mrope_section=list(spec.rope.mrope_section))
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


def _use_megarl_mla_attention(block_spec, use_te: bool) -> None:
    """Every MLA layer of block_spec built as megarl needs, in one pass: the attention module, the down projections
    and, without TE, the core attention. megatron-core's TE MLA spec replicates the q/kv down projections (TELinear
    'duplicated'); its local spec column-splits them. megarl uses the column split on both, so one mapping
    (megarl.bridge.mapping) serves both, with the shared rope key's gradient summed over the TP ranks
    (MLASelfAttentionTP: megatron's column-split path loses the other ranks' shares). Without TE the core attention is
    megarl's MLADotProductAttention (the local one cannot take MLA's head sizes)."""
    from megarl.megatron.mla_rope_grad import MLASelfAttentionTP

    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
    else:
        from megarl.megatron.mla_attention import MLADotProductAttention
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        attention.module = MLASelfAttentionTP
        if use_te:
            attention.submodules.linear_q_down_proj = TEColumnParallelLinear
            attention.submodules.linear_kv_down_proj = TEColumnParallelLinear
        else:
            attention.submodules.core_attention = MLADotProductAttention


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
                    moe_dispatcher: str = "allgather", head_seed: int = 0, fusions: Union[str, bool] = "auto",
                    config=None, **config_overrides):
    """A GPTModel for this rank's pipeline stage (weights randomly initialised; see load_hf_weights / build_and_load).

    The model carries `megarl_spec` (the ArchSpec), `megarl_head` ("lm" or "value") for the bridge and forward, and
    `megarl_fusions` ({fusion: (on, reason)}) and `megarl_te` (built on Transformer Engine's spec).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megarl.megatron.layer_spec import local_block_spec

    use_te = te_available() if use_te is None else use_te
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vp_stage is None:
        raise ValueError(f"virtual pipeline stages are on ({vpp} per PP rank): build one chunk per vp_stage "
                         "(build_model_chunks does)")
    if config is None:  # given: another virtual stage's chunk of the same model shares its config object
        config = transformer_config(spec, dtype=dtype, use_te=use_te, sequence_parallel=sequence_parallel,
                                    moe_dispatcher=moe_dispatcher, fusions=fusions, **config_overrides)
    fusion_state = {name: (getattr(config, name), reason)
                    for name, (_, reason) in fusion_settings(use_te, fusions not in (False, "off")).items()}
    _log_fusions(fusion_state)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if use_te:
        block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                                vp_stage=vp_stage)
    else:
        block_spec = local_block_spec(config, vp_stage=vp_stage)
    if spec.mla is not None:
        _use_megarl_mla_attention(block_spec, use_te)
    rope = spec.rope
    with _tensor_cuda_is_identity_on_cpu(), _output_layer_without_apex(config):
        model = GPTModel(
            config=config, transformer_layer_spec=block_spec,
            vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size, vocab_pad_multiple),
            max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
            position_embedding_type="mrope" if rope.mrope_section else "rope", rotary_percent=rope.partial,
            rotary_base=rope.theta,
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
    if rope.mrope_interleaved:
        from megarl.megatron.vlm import InterleavedMRoPE

        model.rotary_pos_emb = InterleavedMRoPE(model.rotary_pos_emb)
    if spec.vision is not None and pre_process:  # the first stage turns images into embeddings
        from megarl.megatron.vlm import vision_tower

        tower = vision_tower(spec.vision, dtype=config.params_dtype)
        setattr(model, VISION_PREFIX.rstrip("."), tower.cuda() if torch.cuda.is_available() else tower)
    model.megarl_spec = spec
    model.megarl_head = VALUE_HEAD if value_head else LM_HEAD
    model.megarl_fusions = fusion_state
    model.megarl_te = bool(use_te)  # packed micro-batches hand TE their boundaries on the device, others on the host
    if spec.num_experts:  # a pack's end padding goes to no expert (megarl.megatron.moe_padding)
        from megarl.megatron import moe_padding

        moe_padding.install([model])
    return model


_logged_fusions: set = set()


def _log_fusions(state: dict) -> None:
    import logging

    key = tuple(sorted((k, v[0]) for k, v in state.items()))
    if key in _logged_fusions:
        return
    _logged_fusions.add(key)
    log = logging.getLogger("megarl")
    for name, (on, reason) in state.items():
        log.info("fusion %s: %s (%s)", name, "on" if on else "off", reason)


@contextlib.contextmanager
def _output_layer_without_apex(config):
    """With gradient_accumulation_fusion on, Transformer Engine's layers add weight gradients into main_grad
    themselves, but GPTModel's output layer is megatron's ColumnParallelLinear, whose fused path needs apex's
    fused_weight_gradient_mlp_cuda (and refuses to build without it). While GPTModel is built, a ColumnParallelLinear
    sees the fusion off: it then produces an ordinary weight gradient, which megatron's DDP hook adds into main_grad
    (one add for one [vocab, hidden] matrix; every TE layer keeps its fusion)."""
    if not config.gradient_accumulation_fusion:
        yield
        return
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False):  # apex is there: nothing to work around
        yield
        return
    original = layers.ColumnParallelLinear.__init__

    def init(self, *args, **kwargs):
        cfg = kwargs.get("config")
        saved = cfg.gradient_accumulation_fusion
        cfg.gradient_accumulation_fusion = False
        try:
            original(self, *args, **kwargs)
        finally:
            cfg.gradient_accumulation_fusion = saved

    layers.ColumnParallelLinear.__init__ = init
    try:
        yield
    finally:
        layers.ColumnParallelLinear.__init__ = original


def build_model_chunks(spec: ArchSpec, **build_kwargs):
    """This rank's model: one GPTModel, or with virtual pipeline stages (parallelism.virtual_pipeline_model_parallel_
    size = V) a list of V chunks, chunk v holding the layers of virtual stage v * PP + pp_rank (megatron's interleaved
    placement: with PP2 x VPP2 and 8 layers, PP rank 0 holds layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7). The
    embedding lives on chunk 0 of the first PP rank, the final norm and head on the last chunk of the last PP rank.
    Everything downstream (forward, train_step, the bridge) takes either form (megarl.bridge.sharding.unwrap)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return build_gpt_model(spec, **build_kwargs)
    # one TransformerConfig object for all chunks, as megatron's own model builder does: the schedule and
    # finalize_model_grads read settings from chunk 0's config (variable_seq_lengths, finalize_model_grads_func)
    chunks = [build_gpt_model(spec, vp_stage=0, **build_kwargs)]
    chunks += [build_gpt_model(spec, vp_stage=v, config=chunks[0].config, **build_kwargs) for v in range(1, vpp)]
    return chunks


def build_and_load(hf_dir: Union[str, Path], *, value_head: bool = False, strict: bool = True, **build_kwargs):
    """Read config.json, build this rank's model (a GPTModel, or a list of chunks with virtual pipeline stages: see
    build_model_chunks) and load the HF weights into it. Returns (model, spec).

    Call on every rank after init_model_parallel; each rank reads only its own slices of the safetensors files."""
    from megarl.bridge.importer import load_hf_weights

    spec = load_spec(hf_dir)
    model = build_model_chunks(spec, value_head=value_head, **build_kwargs)
    chunks = model if isinstance(model, list) else [model]
    if torch.cuda.is_available():
        for chunk in chunks:
            chunk.cuda()
    report = load_hf_weights(model, hf_dir, spec, strict=strict)
    for chunk in chunks:
        chunk.megarl_load_report = report
    return model, spec
