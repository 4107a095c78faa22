"""HF safetensors -> a megatron-core model in any TP/PP/EP layout, each rank reading only the slices it holds.

Memory per rank is bounded by its own shard plus one HF tensor (in practice one TP chunk of one tensor): tensors
are read with `safe_open(...).get_slice(name)[a:b]`, so a rank never materialises another stage's layers, another
EP rank's experts, or the other TP ranks' chunks.

Before any weight is read, the checkpoint headers are checked against config.json on every rank: each missing
tensor, each shape that differs from what the config implies and each unexpected tensor is reported by name.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch

from megarl.bridge.hf_config import (INDEX_FILE, ArchSpec, BridgeError, load_spec, name_sample, problem_report,
                                     read_index, shard_names)
from megarl.bridge.mapping import LM_HEAD, VALUE_HEAD, Mapping
from megarl.bridge.sharding import local_params, unwrap

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes; never an error.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsCheckpoint:
    """Name -> file index of an HF directory (sharded with model.safetensors.index.json, or single files)."""

    def __init__(self, hf_dir: Union[str, Path]):
        from safetensors import SafetensorError, safe_open

        self.dir = Path(hf_dir)
        self._open = {}
        self._safe_open = safe_open
        self._refused = (SafetensorError, OSError)
        index = self.dir / INDEX_FILE
        if index.is_file():
            self.weight_map = read_index(index)
            self.files = sorted(set(self.weight_map.values()))
            for f in self.files:
                if not (self.dir / f).is_file():
                    names = [n for n, v in self.weight_map.items() if v == f]
                    raise BridgeError(f"{names[0]}: {index.name} maps it (and {len(names) - 1} more tensors) to "
                                      f"{f}, which does not exist in {self.dir}")
        else:
            self.files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not self.files:
                raise BridgeError(f"{self.dir}: no *.safetensors files (megarl reads safetensors checkpoints only)")
            self.weight_map = {}
            for f in self.files:
                for name in self._handle(f).keys():
                    self.weight_map[name] = f

    def _handle(self, file: str):
        if file not in self._open:
            try:
                self._open[file] = self._safe_open(str(self.dir / file), framework="pt", device="cpu")
            except self._refused:  # name the file and what is wrong with it
                shard_names(self.dir / file)
                raise
        return self._open[file]

    def describe(self) -> str:
        return f"{self.dir} ({'index lists' if (self.dir / INDEX_FILE).is_file() else 'found'} {len(self.files)} files)"

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list:
        return list(self.weight_map)

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise BridgeError(f"{name}: missing from {self.describe()}")
        try:
            return self._handle(self.weight_map[name]).get_slice(name)
        except Exception as exc:  # the index lists a tensor its file does not hold
            raise BridgeError(f"{name}: cannot be read from {self.dir / self.weight_map[name]}: {exc}") from exc

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rng: Optional[tuple] = None) -> torch.Tensor:
        """The tensor, or only rows/columns [start, stop) of dim `rng[0]` (nothing else is read from disk)."""
        sl = self._slice(name)
        if rng is None:
            return sl[:]
        dim, start, stop = rng
        index = (slice(None),) * dim + (slice(start, stop),)
        return sl[index]


def check_checkpoint(mapping: Mapping, ckpt: SafetensorsCheckpoint, strict: bool = True) -> list:
    """Check names and shapes (headers only). Returns the HF names that are absent but allowed to be (a critic's
    `score.weight` when loading from a causal-LM checkpoint); raises BridgeError listing every problem."""
    spec = mapping.spec
    problems, optional_absent = [], []
    for name, want in mapping.hf_shapes().items():
        if name not in ckpt:
            if name == "score.weight" and mapping.head == VALUE_HEAD:
                optional_absent.append(name)
                continue
            problems.append(f"{name}: missing from {ckpt.describe()}")
            continue
        got = ckpt.shape(name)
        if got != tuple(want):
            problems.append(f"{name} has shape {got} in the checkpoint but config.json implies {tuple(want)}")
    if strict:
        expected = set(mapping.hf_names())
        allowed = set()
        if mapping.head == VALUE_HEAD or spec.tie_word_embeddings:
            allowed.add("lm_head.weight")  # a critic drops the LM head; tied checkpoints sometimes store a copy
        extra = [n for n in ckpt.names() if n not in expected and n not in allowed and not n.endswith(IGNORED_SUFFIXES)]
        mtp = [n for n in extra if _mtp_layer(n, spec)]
        if mtp:
            # DeepSeek-V3 / GLM-4.5 ship num_nextn_predict_layers multi-token-prediction layers after the decoder
            # (model.layers.{num_hidden_layers + i}.*); transformers does not load them and neither does megarl
            log.warning("%d multi-token-prediction tensors (num_nextn_predict_layers=%d, e.g. %s) are skipped: megarl "
                        "trains and syncs the main model only (vLLM's speculative MTP head keeps its own weights)",
                        len(mtp), spec.mtp_layers, mtp[0])
            extra = [n for n in extra if n not in set(mtp)]
        if extra:
            problems.append(f"{len(extra)} tensors in {ckpt.dir} have no place in a {spec.architecture} with this "
                            f"config.json: {name_sample(extra)}")
    if problems:
        raise BridgeError(problem_report(f"checkpoint {ckpt.dir} does not match its config.json", problems))
    return optional_absent


def _mtp_layer(name: str, spec: ArchSpec) -> bool:
    """Whether `name` belongs to one of the checkpoint's multi-token-prediction layers."""
    if not spec.mtp_layers or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and spec.num_layers <= int(index) < spec.num_layers + spec.mtp_layers


def model_mapping(model, spec: ArchSpec, head: Optional[str] = None) -> Mapping:
    """The Mapping of a model built by megarl.megatron.model (padded vocab and head read from the model)."""
    chunk = unwrap(model)[0]
    head = head or getattr(chunk, "megarl_head", LM_HEAD)
    return Mapping(spec, head=head, padded_vocab=getattr(chunk, "vocab_size", None))


@torch.no_grad()
def load_hf_weights(model, hf_dir: Union[str, Path], spec: Optional[ArchSpec] = None, strict: bool = True) -> dict:
    """Copy the HF weights in `hf_dir` into this rank's shard of `model` (call on every rank).

    Returns {"tensors": n params loaded, "bytes_read": bytes read from disk by this rank,
    "initialised": megatron params left at their initial values (a critic head absent from the checkpoint)}.
    """
    spec = spec or load_spec(hf_dir)
    mapping = model_mapping(model, spec)
    ckpt = SafetensorsCheckpoint(hf_dir)
    absent = set(check_checkpoint(mapping, ckpt, strict=strict))
    loaded, nbytes, initialised = 0, 0, []
    for lp in local_params(model):
        entry = mapping.entry(lp.name)
        if absent.intersection(entry.hf):
            initialised.append(lp.name)
            continue
        tp = lp.tp_size if entry.tp_dim is not None else 1
        rank = lp.tp_rank if entry.tp_dim is not None else 0
        chunks = [ckpt.read(h, mapping.hf_chunk_range(entry, i, rank, tp)) for i, h in enumerate(entry.hf)]
        nbytes += sum(c.numel() * c.element_size() for c in chunks)
        shard = mapping.to_megatron(entry, chunks, tp, rank)
        if tuple(shard.shape) != tuple(lp.param.shape):
            raise BridgeError(f"{lp.local_name} (global {lp.name}) has shape {tuple(lp.param.shape)} on this rank but "
                              f"{list(entry.hf)} give {tuple(shard.shape)}: the model was built from another config")
        lp.param.data.copy_(shard)
        loaded += 1
    return {"tensors": loaded, "bytes_read": nbytes, "initialised": initialised}
