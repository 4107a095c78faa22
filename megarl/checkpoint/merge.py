"""Merge a megarl checkpoint (megatron dist_checkpointing, torch_dist, any TP/PP/EP layout) into a Hugging Face
model directory, on one process, without GPUs, tensor by tensor.

    megarl merge --ckpt RUN_DIR_OR_STEP_DIR --out DIR [--model actor|critic] [--max-shard-size 5GB] [--verify]

How
- The checkpoint directory's torch.distributed.checkpoint metadata (`.metadata`) lists every saved tensor with its
  global shape and the chunks each rank wrote. Megatron saves *global* tensors: layer keys carry the global layer
  index (PP offsets applied), TP shards are chunks of one global tensor (SwiGLU fc1 chunks are placed so the global
  tensor is [gate; up], QKV keeps megatron's per-group interleave), and routed experts of one layer are one key
  `decoder.layers.{L}.mlp.experts.experts.linear_fc{1,2}.weight` with a leading expert dimension.
  So a global checkpoint tensor is exactly the TP=1 megatron tensor, and the bridge's `Mapping.to_hf` (the same
  mapping import, export and weight sync use) turns it into HF tensors.
- An HF tensor whose bytes are one contiguous run of raw checkpoint chunks (embeddings, heads, norms, gate/up halves
  of dim-0 splits, in the output dtype) is copied file to file by the writer (sendfile), never read here.
- Each other megatron tensor is read alone (dcp_reader.DistCheckpoint; experts one expert at a time: only the bytes of
  the chunks overlapping that expert's slice are read, straight from the shard files into place), converted (views
  where the HF layout allows), and handed to a background writer that appends it to the open safetensors shard while
  the next tensor is read.
  At most half the largest tensor's bytes wait in the writer, so peak memory stays under about two copies of the
  largest tensor (one expert's weight for MoE layers), never the model.
- Before anything is read, the checkpoint is checked: meta.json complete, every shard file the metadata names present
  and long enough, every tensor the HF architecture expects present exactly once with the shape the config implies,
  the chunks of each tensor covering it. Shards are planned from the expected names, shapes and dtype; the index is
  written only when every planned tensor was written once (hf_writer.StreamingHFWriter).
- The HF config comes from the run's config (`config.resolved.yaml` in the step directory: model.path, or
  critic.model_path for the critic) or from --hf-config DIR; config.json is rewritten with the output dtype, and for
  the critic as a *ForSequenceClassification value model.

Critic checkpoints export as a value model: `<Family>ForSequenceClassification` with num_labels=1, whose head is
`score.weight` [1, hidden] (megatron's `output_layer.weight` of the critic); the value of token t is
`score(last_hidden_state[:, t])`, which `megarl` loads back as a critic with `critic.model_path`.
"""
from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megarl.bridge.hf_config import ArchSpec, load_spec, name_sample, problem_report, spec_from_dict
from megarl.bridge.mapping import LM_HEAD, VALUE_HEAD, Mapping, canonical_name
from megarl.checkpoint.dcp_reader import CheckpointError, DistCheckpoint
from megarl.checkpoint.locate import LAYOUT_VERSION, checkpoints_dir, complete_checkpoints, is_complete, read_meta

log = logging.getLogger("megarl")

LORA_MARK = ".lora.lora_"  # in the name of every LoRA adapter tensor a LoRA actor saves (megarl.lora.layers)
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\.(linear_fc[12])\.weight$")
# a LoRA actor's expert adapters: one tensor per layer, projection and A/B with a leading expert dimension
_LORA_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\.(linear_fc[12])\.(lora\.lora_[AB]\.\w+)$")
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MergeError(CheckpointError):
    """A checkpoint that cannot be merged (incomplete, or not matching the HF config), or merge arguments that cannot
    be followed; names what."""


# ---------------------------------------------------------------------------------------------------------------------
# Finding the checkpoint and its HF source
# ---------------------------------------------------------------------------------------------------------------------


def resolve_step_dir(path: str | Path) -> Path:
    """A complete `step_<N>` directory from a step directory, a run directory or a checkpoints directory."""
    path = Path(path)
    if not path.exists():
        raise MergeError(f"--ckpt {path}: does not exist")
    if is_complete(path):
        return path
    if re.match(r"^step_\d+(\.tmp)?$", path.name) or (path / "meta.json").exists() or path.name.endswith(".tmp"):
        raise MergeError(f"--ckpt {path}: an incomplete checkpoint (no meta.json with complete=true: the run stopped "
                         "while saving it); merge a complete step_<N> directory")
    for root in (path, checkpoints_dir(path)):
        found = complete_checkpoints(root)
        if found:
            return found[-1][1]
    raise MergeError(f"--ckpt {path}: holds no complete step_<N> checkpoint (looked in {path} and "
                     f"{checkpoints_dir(path)})")


def _resolved_config(step: Path) -> dict:
    import yaml

    for candidate in (step / "config.resolved.yaml", step.parent.parent / "config.resolved.yaml"):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text()) or {}
    return {}


def find_hf_source(step: Path, model: str, hf_config: Optional[str | Path] = None) -> Path:
    """The HF directory whose config.json describes the model (and whose tokenizer files are copied)."""
    if hf_config:
        src = Path(hf_config)
        if not (src / "config.json").is_file():
            raise MergeError(f"--hf-config {src}: no config.json there")
        return src
    cfg = _resolved_config(step)
    model_cfg = cfg.get("model") or {}
    path = None
    if model == "critic":
        path = (cfg.get("critic") or {}).get("model_path")
    path = path or model_cfg.get("path")
    if not path:
        raise MergeError(f"{step}: config.resolved.yaml names no model.path; pass --hf-config DIR (the HF model the "
                         "run started from: config.json and tokenizer files)")
    if not (Path(path) / "config.json").is_file():
        raise MergeError(f"{step}: the run's model.path {path} has no config.json (moved, or another machine); pass "
                         "--hf-config DIR with the HF model the run started from")
    return Path(path)


def tokenizer_source(step: Path) -> Optional[Path]:
    path = (_resolved_config(step).get("model") or {}).get("tokenizer_path")
    return Path(path) if path and Path(path).is_dir() else None


# ---------------------------------------------------------------------------------------------------------------------
# The plan: which checkpoint tensor (slice) makes which HF tensors
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Source:
    key: str  # checkpoint key
    index: tuple = ()  # indices into leading dimensions (stacked layer, expert); () for the whole tensor

    def describe(self) -> str:
        return self.key + (str(list(self.index)) if self.index else "")


@dataclass
class MergePlan:
    spec: ArchSpec
    head: str
    mapping: Mapping
    sources: dict  # entry megatron name -> Source
    dtype: torch.dtype  # output dtype
    checkpoint_dtype: torch.dtype
    hf_tensors: list = field(default_factory=list)  # [(hf name, shape, dtype)] in write order
    lora: dict = field(default_factory=dict)  # LoRA adapter name (megatron module + .lora.lora_A.q_proj) -> Source

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * torch.tensor([], dtype=d).element_size() for _, s, d in self.hf_tensors)

    def largest_tensor_bytes(self) -> int:
        return max(math.prod(s) * torch.tensor([], dtype=d).element_size() for _, s, d in self.hf_tensors)


def _checkpoint_sources(ckpt: DistCheckpoint) -> tuple:
    """{canonical megatron name: Source} over the model tensors of the checkpoint, and the non-model keys skipped."""
    sources, skipped = {}, []
    for key in ckpt.tensors:
        if key.startswith("optimizer") or "_extra_state" in key:
            skipped.append(key)
            continue
        layers = [((), key)]
        m = _STACKED.match(key)
        if m:  # homogeneous layers saved as one tensor with a leading layer dimension
            layers = [((L,), f"decoder.layers.{L}.{m.group(1)}") for L in range(ckpt.shape(key)[0])]
        for index, name in layers:
            m = _EXPERTS.match(name)
            lm = _LORA_EXPERTS.match(name)
            if m:  # routed experts of a layer: one tensor with a leading expert dimension
                for e in range(ckpt.shape(key)[len(index)]):
                    sources[f"{m.group(1)}.local_experts.{e}.{m.group(2)}.weight"] = Source(key, index + (e,))
            elif lm:
                for e in range(ckpt.shape(key)[len(index)]):
                    sources[f"{lm.group(1)}.local_experts.{e}.{lm.group(2)}.{lm.group(3)}"] = Source(key, index + (e,))
            else:
                sources[canonical_name(name)] = Source(key, index)
    return sources, skipped


def plan_merge(ckpt: DistCheckpoint, spec: ArchSpec, head: str = LM_HEAD,
               dtype: Optional[torch.dtype] = None) -> MergePlan:
    """Match the checkpoint against the HF architecture; raise MergeError listing every problem."""
    sources, _ = _checkpoint_sources(ckpt)
    emb = sources.get("embedding.word_embeddings.weight")
    if emb is None:
        raise MergeError(f"{ckpt.dir}: no embedding.word_embeddings.weight (the first pipeline stage's files are "
                         "missing, or this is not a megarl model checkpoint)")
    padded = ckpt.shape(emb.key)[0]
    if padded < spec.vocab_size:
        raise MergeError(f"{ckpt.dir}: embedding has {padded} rows, config.json vocab_size={spec.vocab_size}; "
                         "--hf-config does not describe this checkpoint")
    mapping = Mapping(spec, head=head, padded_vocab=padded)
    problems, used = [], set()
    dtypes: dict = {}  # dtype -> bytes
    for entry in mapping.entries:
        src = sources.get(entry.megatron)
        if src is None:
            problems.append(f"{entry.megatron} (HF {', '.join(entry.hf)}): missing from the checkpoint")
            continue
        used.add(entry.megatron)
        got = ckpt.shape(src.key)[len(src.index):]
        want = mapping.megatron_shape(entry, tp=1)
        if tuple(got) != tuple(want):
            problems.append(f"{entry.megatron}: shape {tuple(got)} in the checkpoint ({src.describe()}), the HF config "
                            f"implies {tuple(want)}")
        dt = ckpt.dtype(src.key)
        dtypes[dt] = dtypes.get(dt, 0) + math.prod(got) * torch.tensor([], dtype=dt).element_size()
    tied_copy = {"output_layer.weight"} if spec.tie_word_embeddings and head == LM_HEAD else set()
    lora = {n: s for n, s in sources.items() if LORA_MARK in n}  # adapters of a LoRA actor (megarl.lora)
    extra = sorted(n for n in sources if n not in used and n not in tied_copy and n not in lora)
    if extra:
        problems.append(f"{len(extra)} checkpoint tensors have no place in a {spec.architecture} with this config: "
                        f"{name_sample(extra)}")
    if problems:
        raise MergeError(problem_report(f"checkpoint {ckpt.dir} does not match {spec.architecture}", problems))
    # megatron keeps some tensors (norm weights of the local spec) in float32 next to bfloat16 weights: the
    # checkpoint's dtype is the one holding most bytes, and an HF model has one dtype
    ckpt_dtype = max(dtypes, key=dtypes.get)
    if len(dtypes) > 1:
        log.info("checkpoint %s mixes dtypes %s; writing %s", ckpt.dir, {str(k): v for k, v in dtypes.items()},
                 dtype or ckpt_dtype)
    out_dtype = dtype or ckpt_dtype
    plan = MergePlan(spec, head, mapping, {e.megatron: sources[e.megatron] for e in mapping.entries}, out_dtype,
                     ckpt_dtype, lora=lora)
    plan.hf_tensors = [(h, tuple(mapping.hf_shape(h)), out_dtype) for h in mapping.hf_names()]
    # every HF name exactly once
    names = [h for h, _, _ in plan.hf_tensors]
    if len(names) != len(set(names)):
        raise MergeError(f"the {spec.family} mapping names some HF tensors twice: "
                         f"{sorted({n for n in names if names.count(n) > 1})[:8]}")
    return plan


def stream_hf_tensors(ckpt: DistCheckpoint, plan: MergePlan, before_read=None, deltas: Optional[dict] = None):
    """Yield (hf_name, tensor) in plan order; one megatron tensor (or one expert slice) in memory at a time.

    before_read(nbytes): called with the output bytes of each megatron tensor before it is read (a writer that still
    holds earlier tensors waits there until they fit).
    deltas: {hf name: (A, B, scaling)}: those tensors are written as base + (B @ A) * scaling, PEFT's merge (LoRA)."""
    sizes = {h: math.prod(shape) * torch.tensor([], dtype=d).element_size() for h, shape, d in plan.hf_tensors}
    deltas = deltas or {}
    for entry in plan.mapping.entries:
        src = plan.sources[entry.megatron]
        adapted = any(h in deltas for h in entry.hf)
        direct = None if adapted else _verbatim(ckpt, plan, entry, src)
        if direct is not None:  # bytes already laid out as HF stores them: copied file to file, never read here
            yield from direct
            continue
        if before_read is not None:
            before_read(sum(sizes[h] for h in entry.hf))
        tensor = ckpt.read(src.key, src.index)
        for name, t in plan.mapping.to_hf(entry, [tensor], views=True):  # views: no copy the writer does not need
            if name in deltas:
                a, b, scaling = deltas[name]
                t = t.to(a.dtype) + (b @ a) * scaling
            t = t.to(plan.dtype)
            if not _any_nonzero(t) and _any_nonzero(tensor):
                raise MergeError(f"{name}: all zeros after conversion from {src.describe()}, which is not all zeros")
            yield name, t
        del tensor


def _verbatim(ckpt: DistCheckpoint, plan: MergePlan, entry, src: Source) -> Optional[list]:
    """[(hf name, FileBytes)] when every HF tensor of the entry is, byte for byte, one contiguous run of the
    checkpoint tensor (same dtype; the conversion is a row slice: embeddings, heads, norms, gate/up halves) lying in
    raw chunks; else None. The conversion is traced on a meta tensor, so nothing is read to find out."""
    from megarl.checkpoint.hf_writer import FileBytes

    if ckpt.dtype(src.key) != plan.dtype:
        return None
    shape = ckpt.shape(src.key)
    k = len(src.index)
    base = sum(i * math.prod(shape[d + 1:]) for d, i in enumerate(src.index))  # first element of the slice
    meta = torch.empty(shape[k:], dtype=plan.dtype, device="meta")
    out = []
    for name, t in plan.mapping.to_hf(entry, [meta], views=True):
        if not (t is meta or t._base is meta) or not t.is_contiguous():
            return None
        ranges = ckpt.file_ranges(src.key, base + t.storage_offset(), t.numel())
        if ranges is None:
            return None
        out.append((name, FileBytes(tuple(t.shape), plan.dtype, tuple(ranges))))
    return out


def _any_nonzero(t: torch.Tensor) -> bool:
    """t.any(), looking at a short prefix first: a weight is rarely zero at its start, and a full any() over bfloat16
    costs several times a copy."""
    flat = t.reshape(-1)
    return bool(flat[:4096].any()) or bool(flat.any())


def lora_settings(step: Path):
    """The LoraSettings of a LoRA actor's checkpoint, from the run's config.resolved.yaml (actor.lora)."""
    from megarl.lora.targets import LoraSettings

    lo = (_resolved_config(step).get("actor") or {}).get("lora") or {}
    if not lo.get("rank"):
        raise MergeError(f"{step}: the checkpoint holds LoRA adapters but its config.resolved.yaml has no actor.lora "
                         "rank (alpha is needed to merge them)")
    targets = lo.get("target_modules", "all-linear")
    return LoraSettings(rank=int(lo["rank"]), alpha=float(lo.get("alpha", 16.0)), dropout=float(lo.get("dropout", 0.0)),
                        target_modules=targets if isinstance(targets, str) else tuple(targets))


def lora_adapters(ckpt: DistCheckpoint, plan: MergePlan, step: Path) -> tuple:
    """The LoRA adapters saved with a LoRA actor: ({PEFT key: whole tensor}, LoraSettings). Each adapter tensor is
    one global checkpoint tensor (TP shards are its chunks), named after the megatron linear it adapts."""
    from megarl.lora.targets import ALIASES, Target

    settings = lora_settings(step)
    out = {}
    for name, src in sorted(plan.lora.items()):
        module, rest = name.split(LORA_MARK)
        which, proj = rest.split(".", 1)
        entry = plan.mapping.by_megatron.get(module + ".weight")
        hf = [h for h in (entry.hf if entry else ()) if ALIASES.get(h.split(".")[-2], h.split(".")[-2]) == proj]
        if not hf:
            raise MergeError(f"{src.describe()}: LoRA adapter of no {plan.spec.architecture} linear")
        slot = entry.hf.index(hf[0])
        target = Target(entry, slot, hf[0], proj, tuple(plan.mapping.hf_shape(hf[0])), "column")
        out[target.peft_key(which)] = ckpt.read(src.key, src.index).float()
    return out, settings


# ---------------------------------------------------------------------------------------------------------------------
# The merge
# ---------------------------------------------------------------------------------------------------------------------


def _output_config(source: Path, spec: ArchSpec, head: str, dtype: torch.dtype) -> dict:
    cfg = json.loads((source / "config.json").read_text())
    name = str(dtype).replace("torch.", "")
    cfg["torch_dtype"] = name
    cfg["dtype"] = name
    arch = cfg["architectures"][0]
    if head == VALUE_HEAD:
        cfg["architectures"] = [arch.replace("ForCausalLM", "ForSequenceClassification")]
        cfg["num_labels"] = 1
        cfg["id2label"] = {"0": "LABEL_0"}
        cfg["label2id"] = {"LABEL_0": 0}
        cfg["tie_word_embeddings"] = False
    elif arch.endswith("ForSequenceClassification"):  # an actor started from a reward model's backbone
        cfg["architectures"] = [arch.replace("ForSequenceClassification", "ForCausalLM")]
    return cfg


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise MergeError(f"--out {out}: exists and is not empty; pass --force to replace it")


@dataclass
class MergeReport:
    out: Path
    step_dir: Path
    model: str
    tensors: int
    bytes: int
    seconds: float
    largest_tensor_bytes: int
    dtype: str
    checkpoint_dtype: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def merge(ckpt_path: str | Path, out: str | Path, *, model: str = "actor", hf_config: Optional[str | Path] = None,
          max_shard_size="5GB", dtype: Optional[str] = None, force: bool = False, progress: bool = True,
          lora: str = "merged") -> MergeReport:
    """Merge one model of a megarl checkpoint into an HF directory (see the module docstring).

    A LoRA actor's checkpoint (frozen base + adapters): lora="merged" writes base + (B @ A) * alpha/rank for every
    adapted HF weight (PEFT's merge, in float32 before any --dtype cast); lora="adapter" writes only a PEFT adapter
    directory (adapter_config.json + adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the
    base (the run's model.path)."""
    from megarl.checkpoint.hf_writer import StreamingHFWriter, parse_size

    t0 = time.perf_counter()
    out = Path(out)
    _check_out(out, force)
    step = resolve_step_dir(ckpt_path)
    meta = read_meta(step) or {}
    if meta.get("layout") != LAYOUT_VERSION:
        raise MergeError(f"{step}: checkpoint layout {meta.get('layout')!r}; this megarl merges {LAYOUT_VERSION!r}")
    if model not in meta.get("models", []):
        raise MergeError(f"{step}: holds no {model!r} model (it holds {meta.get('models')})")
    source = find_hf_source(step, model, hf_config)
    head = VALUE_HEAD if model == "critic" else LM_HEAD
    spec = load_spec(source)
    if spec.score_head and head == LM_HEAD:
        spec = spec_from_dict({**json.loads((source / "config.json").read_text()),
                               "architectures": [spec.architecture.replace("ForSequenceClassification",
                                                                           "ForCausalLM")]})
    ckpt = DistCheckpoint(step / model)
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise MergeError(f"--dtype {dtype}: choose from {sorted(OUTPUT_DTYPES)}")
    plan = plan_merge(ckpt, spec, head, OUTPUT_DTYPES.get(dtype) if dtype else None)
    ckpt.check_files({s.key for s in plan.sources.values()})
    deltas = None
    if lora not in ("merged", "adapter"):
        raise MergeError(f"--lora {lora}: choose merged or adapter")
    if plan.lora:
        from megarl.lora.targets import PEFT_PREFIX

        adapters, settings = lora_adapters(ckpt, plan, step)
        if lora == "adapter":
            from megarl.lora.peft_io import write_adapter

            write_adapter(out, adapters, settings, base_model_path=str(source))
            ckpt.close()
            nbytes = sum(t.numel() * t.element_size() for t in adapters.values())
            return MergeReport(out, step, model, len(adapters), nbytes, time.perf_counter() - t0,
                               max(t.numel() * t.element_size() for t in adapters.values()), "float32",
                               str(plan.checkpoint_dtype).replace("torch.", ""))
        deltas = {}
        for key, a in adapters.items():
            if key.endswith(".lora_A.weight"):
                stem = key[len(PEFT_PREFIX): -len(".lora_A.weight")]
                deltas[stem + ".weight"] = (a, adapters[key.replace(".lora_A.", ".lora_B.")], settings.scaling)
    elif lora == "adapter":
        raise MergeError(f"{step}: --lora adapter, but the {model} checkpoint holds no LoRA adapters")

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"merge {model}",
                   file=sys.stderr, dynamic_ncols=True)
    # written in the background while the next tensors are read; at most half the largest tensor's bytes queued, so
    # the largest tensor, read while the writer drains, keeps the peak under two of it
    writer = StreamingHFWriter(out, plan.hf_tensors, parse_size(max_shard_size),
                               on_bytes=bar.update if bar is not None else None,
                               pending_bytes=plan.largest_tensor_bytes() // 2)
    threads = torch.get_num_threads()
    # the tensor work is copies, bound by memory, and the writer thread needs a core: torch's thread pool would only
    # add barriers (which, on a busy machine, cost more than the copies themselves)
    torch.set_num_threads(1)
    try:
        count = 0
        for name, tensor in stream_hf_tensors(ckpt, plan, before_read=writer.wait_for_room, deltas=deltas):
            writer.write(name, tensor)
            count += 1
        config = _output_config(source, spec, head, plan.dtype)
        tok = tokenizer_source(step)
        writer.finish(source, config=config)
        if tok is not None:
            import shutil

            from megarl.checkpoint.hf_writer import _COPIED

            for fname in _COPIED:
                if fname not in ("config.json", "generation_config.json") and (tok / fname).exists():
                    shutil.copy2(tok / fname, out / fname)
    except BaseException:
        writer.abort()
        raise
    finally:
        torch.set_num_threads(threads)
        ckpt.close()
        if bar is not None:
            bar.close()
    report = MergeReport(out, step, model, count, plan.nbytes, time.perf_counter() - t0, plan.largest_tensor_bytes(),
                         str(plan.dtype).replace("torch.", ""), str(plan.checkpoint_dtype).replace("torch.", ""))
    return report
