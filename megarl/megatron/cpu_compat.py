"""Make megatron-core (local layer spec, no Transformer Engine/Apex) run on a CPU-only torch build.

megatron-core assumes CUDA in a few dozen places. On a machine without CUDA, `apply()` patches exactly
those places; on a CUDA machine it does nothing. Every patch names the megatron symbols it relies on and
`apply()` first checks that they all still exist, so an upgrade of megatron-core that moves one fails
at start-up with the list of what moved, instead of as an obscure error deep in a training step.

Tested against megatron-core 0.16.1 (pinned in constraints-cpu.txt).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch

TESTED_MEGATRON_VERSION = "0.16.1"

# Factory functions that megatron modules call with a hard-coded device="cuda".
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")

# Modules whose module-level `torch` name is replaced by a proxy that maps device="cuda" to the CPU.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
)


class MegatronCompatError(RuntimeError):
    """The installed megatron-core lacks a symbol the CPU compatibility layer patches."""


@dataclass(frozen=True)
class _Patch:
    name: str
    why: str  # the error megatron raises on CPU without this patch
    requires: tuple[str, ...]  # "module:attr" symbols that must exist
    apply: Callable[[], None]


_applied: list[str] = []


def _to_cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and str(device).startswith("cuda"):
        kwargs["device"] = "cpu"
    return kwargs


class _TorchCpuProxy:
    """Stands in for `torch` inside one megatron module; only the tensor factories differ."""

    def __init__(self, real):
        self._real = real
        for fname in _FACTORIES:
            fn = getattr(real, fname)
            setattr(self, fname, (lambda f: lambda *a, **k: f(*a, **_to_cpu_device(k)))(fn))

    def __getattr__(self, name):
        return getattr(self._real, name)


def _patch_current_device():
    torch.cuda.current_device = lambda: torch.device("cpu")


def _patch_rng_tracker():
    import megatron.core.tensor_parallel.random as rnd

    rnd._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    rnd._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    # On CPU the "CUDA" tracker state *is* the CPU generator, so every fork logs a spurious warning.
    logging.getLogger(rnd.__name__).setLevel(logging.ERROR)


def _patch_cuda_literals():
    for modname in _CUDA_LITERAL_MODULES:
        mod = importlib.import_module(modname)
        if not isinstance(mod.torch, _TorchCpuProxy):
            mod.torch = _TorchCpuProxy(torch)
    torch.cuda.synchronize = lambda *a, **k: None


class _Event:
    def record(self, *a, **k): pass
    def synchronize(self): pass
    def wait(self, *a, **k): pass
    def query(self): return True


class _Stream:
    def __init__(self, *a, **k): pass
    def wait_stream(self, other): pass
    def wait_event(self, event): pass
    def record_event(self, event=None): return event or _Event()
    def synchronize(self): pass
    def query(self): return True


def _patch_streams():
    current = _Stream()
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *a, **k: current
    torch.cuda.default_stream = lambda *a, **k: current
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()


_MOE_TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
                 "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute")


def _patch_moe_missing_te():
    import megatron.core.transformer.moe.moe_utils as mu

    for name in _MOE_TE_NAMES:
        if not hasattr(mu, name):
            setattr(mu, name, None)


def _patch_alltoall_split_sizes():
    import megatron.core.transformer.moe.moe_utils as mu
    import megatron.core.transformer.moe.token_dispatcher as td

    original = mu.maybe_move_tensor_to_cpu
    if getattr(original, "_megarl_cpu", False):
        return

    def move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._megarl_cpu = True
    mu.maybe_move_tensor_to_cpu = move
    if hasattr(td, "maybe_move_tensor_to_cpu"):
        td.maybe_move_tensor_to_cpu = move


def _patch_norm_sequence_parallel():
    import megatron.core.transformer.torch_norm as tn

    original_new = tn.WrappedTorchNorm.__new__
    if getattr(original_new, "_megarl_cpu", False):
        return

    def new(cls, config, hidden_size, eps=1e-5, **kw):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kw)
        finally:
            config.sequence_parallel = sp
        # finalize_model_grads all-reduces grads of params tagged sequence_parallel over TP.
        for p in norm.parameters():
            setattr(p, "sequence_parallel", sp)
        return norm

    new._megarl_cpu = True
    tn.WrappedTorchNorm.__new__ = new


def _patch_grad_clip():
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.optimizer.optimizer as mo
    from megatron.core.utils import to_local_if_dtensor

    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                 if getattr(p, attr, None) is not None]
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)

    cg.clip_grad_by_total_norm_fp32 = clip
    mo.clip_grad_by_total_norm_fp32 = clip


def _patch_mla_without_te():
    import megatron.core.transformer.multi_latent_attention as mla

    # the module sets HAVE_TE when megatron's TE extension module imports, even with TE itself absent (its classes
    # are then MagicMock placeholders), and later tests isinstance(linear_proj, TELinear)
    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def _patch_cp_pos_emb():
    import megatron.core.models.common.embeddings.rope_utils as ru
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn

    def on_this_cp_rank(pos_emb, seq_dim, cp_group):
        """megatron's function (chunks r and 2*CP-1-r of the sequence dimension) with its index on pos_emb's
        device instead of a pinned host copy sent to CUDA."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp, r = cp_group.size(), cp_group.rank()
        idx = torch.tensor([r, 2 * cp - r - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    ru.get_pos_emb_on_this_cp_rank = on_this_cp_rank
    yarn.get_pos_emb_on_this_cp_rank = on_this_cp_rank


def _patch_float16_optimizer_on_cpu():
    """bf16/fp16 training keeps fp32 main params in megatron's Float16OptimizerWithFloat16Params, whose __init__ sorts
    parameters by their CUDA type names (param.type() in 'torch.cuda.BFloat16Tensor' / 'torch.cuda.HalfTensor' /
    'torch.cuda.FloatTensor') and raises TypeError on any other. While it runs, each CPU parameter answers type()
    (without arguments) with its CUDA name; nothing else changes: the fp32 copies, the step and the copy back are
    megatron's own, on the CPU."""
    import megatron.core.optimizer.optimizer as mo

    cls = mo.Float16OptimizerWithFloat16Params
    original = cls.__init__
    if getattr(original, "_megarl_cpu", False):
        return

    def init(self, optimizer, *args, **kwargs):
        shimmed = []
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.device.type == "cpu" and "type" not in p.__dict__:
                    cuda_name = torch.Tensor.type(p).replace("torch.", "torch.cuda.", 1)
                    p.type = (lambda name, t: lambda *a, **k: name if not a and not k
                              else torch.Tensor.type(t, *a, **k))(cuda_name, p)
                    shimmed.append(p)
        try:
            original(self, optimizer, *args, **kwargs)
        finally:
            for p in shimmed:
                del p.type

    init._megarl_cpu = True
    cls.__init__ = init


PATCHES: tuple[_Patch, ...] = (
    _Patch("current_device", "AssertionError: Torch not compiled with CUDA enabled (torch.cuda.current_device() "
           "as a tensor device in ~175 places)", (), _patch_current_device),
    _Patch("rng_tracker", "CudaRNGStatesTracker uses torch.cuda RNG state; dropout forks raise "
           "'cuda rng state model-parallel-rng is not added'",
           ("megatron.core.tensor_parallel.random:_get_cuda_rng_state",
            "megatron.core.tensor_parallel.random:_set_cuda_rng_state"), _patch_rng_tracker),
    _Patch("cuda_literals", "device='cuda' literals in schedules, optimizer, grad buffers, clip_grads, MoE utils; "
           "torch.cuda.synchronize() after p2p batch_isend_irecv",
           tuple(f"{m}:torch" for m in _CUDA_LITERAL_MODULES), _patch_cuda_literals),
    _Patch("streams", "MoEAlltoAllTokenDispatcher creates torch.cuda.Stream(): 'torch.cuda.Stream requires CUDA "
           "support'", ("megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher",), _patch_streams),
    _Patch("moe_missing_te", "RouterGatingLinearFunction tests te_general_gemm, only defined when TE imports: "
           "NameError", ("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",), _patch_moe_missing_te),
    _Patch("alltoall_split_sizes", "all_to_all split sizes stay tensors on CPU: 'all_to_all_single(): "
           "incompatible function arguments'",
           ("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",), _patch_alltoall_split_sizes),
    _Patch("norm_sequence_parallel", "WrappedTorchNorm asserts 'sequence parallel not supported by torch "
           "LayerNorm' (MoE with TP>1 requires sequence parallel)",
           ("megatron.core.transformer.torch_norm:WrappedTorchNorm",), _patch_norm_sequence_parallel),
    _Patch("grad_clip", "clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor",
           ("megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
            "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
            "megatron.core.utils:to_local_if_dtensor"), _patch_grad_clip),
    _Patch("mla_without_te", "MLASelfAttention: 'isinstance() arg 2 must be a type' (TELinear is a placeholder while HAVE_TE)",
           ("megatron.core.transformer.multi_latent_attention:HAVE_TE",
            "megatron.core.transformer.multi_latent_attention:TELinear"), _patch_mla_without_te),
    _Patch("cp_pos_emb", "get_pos_emb_on_this_cp_rank (YaRN rope at context parallelism) pins a host index and "
           "sends it to CUDA: 'pin_memory=True requires a CUDA or other accelerator backend'",
           ("megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",
            "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:get_pos_emb_on_this_cp_rank"),
           _patch_cp_pos_emb),
    _Patch("float16_optimizer", "bf16/fp16 parameters with fp32 main params: Float16OptimizerWithFloat16Params raises "
           "'TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ... Received torch.BFloat16Tensor'",
           ("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",), _patch_float16_optimizer_on_cpu),
)


def missing_symbols() -> list[str]:
    """Return the "module:attr" symbols the patches need that the installed megatron-core lacks."""
    missing = []
    for patch in PATCHES:
        for symbol in patch.requires:
            modname, attr = symbol.split(":")
            try:
                mod = importlib.import_module(modname)
            except ImportError as exc:
                missing.append(f"{symbol} (module does not import: {exc})")
                continue
            if not hasattr(mod, attr):
                missing.append(f"{symbol} (patch '{patch.name}')")
    return missing


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def apply(force: bool = False) -> list[str]:
    """Apply every CPU patch once when CUDA is absent (or `force`); return the names applied so far.

    Raises MegatronCompatError, naming each missing symbol and the installed version, when megatron-core
    has changed under the patches.
    """
    if torch.cuda.is_available() and not force:
        return []
    if _applied:
        return list(_applied)
    missing = missing_symbols()
    if missing:
        raise MegatronCompatError(
            f"megarl's CPU compatibility layer was written for megatron-core {TESTED_MEGATRON_VERSION}, "
            f"but the installed megatron-core {megatron_version()} lacks: " + "; ".join(missing)
            + f". Install the tested version (pip install megatron-core=={TESTED_MEGATRON_VERSION}) or run on CUDA.")
    for patch in PATCHES:
        patch.apply()
        _applied.append(patch.name)
    return list(_applied)
