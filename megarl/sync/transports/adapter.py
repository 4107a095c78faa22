"""Adapter sync (actor.lora.sync: adapter): after each update only the LoRA adapters go to the engine, which keeps the
base weights it started with and generates through vLLM's LoRA support.

    sync = AdapterSync(actor.chunks, topology, settings, engine_dtype)      # every rank
    metrics = sync.run(engine)                                               # a collective; the owners load

How. Every trainer rank holds its TP/PP/EP shards of the adapters; `megarl.lora.layers.gather_adapters` (the same
LoRA<->PEFT naming the PEFT export uses: `Target.peft_key`, each TP shard placed by the bridge mapping) assembles
the whole PEFT-named tensors on each engine owner. The owner writes them into one shared-memory file
(megarl.sync.wire.write_adapter_file: name, dtype, shape, offset per tensor) and calls the engine's `load_adapter`:
each vLLM worker maps the file and builds a LoRAModel with vLLM's own `LoRAModel.from_lora_tensors` (vLLM slices the
whole A and B for its TP rank when it activates the adapter), registers it under a new integer id and drops the
previous adapter
(megarl.rollout.vllm.worker_ext.MegarlWorkerExtension.megarl_add_adapter). Every later generate request carries the
LoRARequest of that id. No base weight moves, and nothing but the file name and small metadata crosses vLLM's RPC.

Bytes per sync: the adapters once per engine replica, sum over adapted projections of rank * (in + out) elements in
the engine dtype (megarl.sync.wire.adapter_bytes), where the merged sync moves the whole model.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any, Optional

import torch

from megarl.lora.targets import LoraSettings
from megarl.lora.vllm import lora_engine_settings
from megarl.sync.wire import shm_dir, write_adapter_file

log = logging.getLogger(__name__)


class AdapterSync:
    """The adapter sync of one run (see the module docstring). chunks: the actor's model chunks; topology: the
    engines' placement over the trainer ranks (megarl.rollout.replicas.EngineTopology); engine_dtype: the dtype the
    engine computes in (the adapters are sent in it)."""

    def __init__(self, chunks, topology, engine_dtype: torch.dtype, base=None):
        self.chunks = chunks
        self.topology = topology
        self.dtype = engine_dtype
        self.base = base  # a full-weight sync run once before the first adapter (an engine started with dummy weights)
        self.syncs = 0

    def run(self, engine: Any, verify: bool = False) -> dict:
        """Gather the adapters on every engine owner and load them there (a collective over all trainer ranks)."""
        import torch.distributed as dist

        from megarl.lora.layers import adapters_disabled, gather_adapters

        t0 = time.perf_counter()
        metrics: dict = {}
        if self.base is not None and self.syncs == 0:  # the engine's base weights, once: the adapters switched off
            with adapters_disabled(self.chunks):
                metrics.update(self.base.run(engine, verify=verify))
        owners = [self.topology.owner(r) for r in range(self.topology.replicas)]
        many = dist.is_initialized() and dist.get_world_size() > 1
        tg = time.perf_counter()
        tensors = gather_adapters(self.chunks, dst=None if len(owners) > 1 else owners[0])
        gather_s = time.perf_counter() - tg
        out = {}
        if engine is not None and tensors is not None:
            path = os.path.join(shm_dir(), f"megarl-adapter-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                meta = write_adapter_file(tensors, path, self.dtype)
                t1 = time.perf_counter()
                out = engine.load_adapter(meta, verify=verify)
                load_s = time.perf_counter() - t1
            finally:
                if os.path.exists(path):
                    os.unlink(path)
            out = {**out, "weight_sync/engine_load_seconds": load_s}
        self.syncs += 1
        if many:
            dist.barrier()  # every rank leaves once every engine holds the new adapter
        seconds = time.perf_counter() - t0
        if "weight_sync/adapter_bytes" in out:  # not from an engine lost during the load (it is synced again)
            metrics.update({k: v for k, v in out.items() if k != "weight_sync/bytes"})
            sent = out["weight_sync/adapter_bytes"]
            # each replica receives the adapters once: what moved into engines per sync, all replicas together
            metrics.update({"sync/bytes": sent * len(owners), "weight_sync/bytes": sent * len(owners)
                            + metrics.get("weight_sync/bytes", 0.0),
                            "weight_sync/gather_seconds": gather_s, "weight_sync/seconds": seconds,
                            "weight_sync/mode_adapter": 1.0})
        return metrics


def engine_lora(cfg, model_path: str) -> Optional[dict]:
    """The engine's LoRA settings of a recipe (lora_engine_settings), None unless actor.lora.sync is adapter. The
    adapted projections come from the model's bridge mapping ("all-linear": every linear the architecture has)."""
    lo = cfg.actor.lora
    if not (lo.enabled and lo.sync == "adapter"):
        return None
    import json
    from pathlib import Path

    from megarl.bridge.hf_config import spec_from_dict
    from megarl.bridge.mapping import Mapping
    from megarl.lora.targets import resolve_targets

    source = Path(model_path) / "config.json"
    tm = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
    settings = LoraSettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=tm)
    targets = resolve_targets(Mapping(spec_from_dict(json.loads(source.read_text()), str(source))), settings)
    return lora_engine_settings(settings, [t.projection for t in targets.targets])
