"""Engine hosts without vLLM for the remote weight sync's multi-rank tests (tests/dist/test_remote_transfer.py,
test_remote_restart.py): a host process with megarl's real WeightReceiver and a stand-in engine that assembles what
each worker's bucket files hold, behind an engine handle with the interface RayEngine and EngineProcess give
megarl.sync.transports.remote; faults on request (a failing load, a dying process, a flipped weight).
"""
import multiprocessing as mp
import os

import torch


class AssemblingEngine:
    """Stands in for VLLMEngine on the host: reads each worker's bucket files as megarl's worker extension does, and
    with verify compares what it holds after the update with what the files gave it, as the extension reads back a
    worker's memory (True: every tensor; a list: those HF names)."""

    def __init__(self, layouts, fail_at=None, die_at=None, corrupt_at=None):
        self.layouts = layouts
        self.version = 0
        self.fail_at = fail_at  # (sync, bucket): raise there, as a worker failing to load would
        self.die_at = die_at  # (sync, bucket): the process dies there, as a crashed engine host would
        self.corrupt_at = corrupt_at  # (sync, hf name): one element of worker 0's copy flipped after it loaded
        self.loads = 0

    def begin_update(self, verify=False):
        self.got = [{} for _ in self.layouts]
        self.sums = [{} for _ in self.layouts] if verify else None
        self.sample = None if isinstance(verify, bool) else set(verify)
        self.loads = self.loaded = 0

    def load_bucket(self, metas):
        from megarl.sync.wire import open_bucket, region

        self.loads += 1
        if self.fail_at and (self.version + 1, self.loads) == self.fail_at:
            raise RuntimeError("worker 0 failed to load bucket 2")
        if self.die_at and (self.version + 1, self.loads) == self.die_at:
            os._exit(3)
        for w, meta in enumerate(metas):
            if not meta:
                continue
            buf = open_bucket(meta["path"], int(meta["size"]))
            for name, dtype, shape, offset, _need, boxes in meta["tensors"]:
                full = region(buf, dtype, shape, int(offset))
                into = self.got[w].setdefault(name, torch.full(tuple(shape), float("nan"), dtype=full.dtype))
                for box in boxes:
                    sl = tuple(slice(lo, hi) for lo, hi in box)
                    into[sl] = full[sl]
                    self.loaded += into[sl].numel() * into.element_size()
                    if self.sums is not None and (self.sample is None or name in self.sample):
                        self.sums[w][(name, box_key(box))] = full[sl].clone()

    def abort_update(self):
        self.got = None

    def end_update(self):
        self.version += 1
        if self.corrupt_at and self.corrupt_at[0] == self.version:
            t = self.got[0][self.corrupt_at[1]].view(-1)
            t[t.numel() // 2] = -t[t.numel() // 2] + 1  # one element, in what the worker computes with
        metrics = {"weight_sync/version": float(self.version), "weight_sync/engine_bytes": float(self.loaded),
                   "got": self.got}
        if self.sums is not None:
            from megarl.sync.weights import compare_checksums, tensor_checksum

            for w, loaded in enumerate(self.sums):
                held = {f"{n}{b}": tensor_checksum(self.got[w][n][tuple(slice(lo, hi) for lo, hi in b)])
                        for n, b in loaded}
                report = compare_checksums({f"{n}{b}": tensor_checksum(t) for (n, b), t in loaded.items()}, held)
                if not report["ok"]:
                    raise RuntimeError(f"weight sync verification failed at version {self.version} on engine worker "
                                       f"{w}: mismatched {report['mismatched'][:8]}")
            metrics["weight_sync/verified_tensors"] = float(sum(len(x) for x in self.sums))
        return metrics


def box_key(box):
    return tuple(tuple(int(x) for x in side) for side in box)


def _host(conn, layouts, faults):
    from megarl.rollout.hosting.receiver import WeightReceiver

    receiver = WeightReceiver(AssemblingEngine(layouts, **faults))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        try:
            if cmd == "join":
                receiver.join(*args)
                conn.send(None)
            elif cmd == "leave":
                receiver.leave()
                conn.send(None)
            elif cmd == "plan":
                receiver.plan = args[0]
                conn.send(None)
            else:
                conn.send(receiver.receive(*args))
        except BaseException as exc:  # noqa: BLE001 - the test sees it
            conn.send(exc)


class HostHandle:
    """An engine handle with one host process (the interface RayEngine and EngineProcess give remote.py)."""

    def __init__(self, layouts, **faults):
        self.layouts = layouts
        self._start(faults)

    def _start(self, faults):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host, args=(child, self.layouts, faults), daemon=True)
        self.proc.start()
        child.close()  # the host's end lives in the host only: its death reads as EOF here

    def restart(self):
        """A fresh host process in place of this one (dead or alive), as a restarted engine: nothing received."""
        self.shutdown()
        self._start({})

    def _ask(self, *msg):
        from megarl.rollout.protocol import Deferred

        self.conn.send(msg)

        def answer():
            out = self.conn.recv()
            if isinstance(out, BaseException):
                raise out
            return out
        return Deferred(answer)

    def transfer_layouts(self):
        return [self.layouts]

    def start_join_transfer(self, spec, first_rank):
        return self._ask("join", spec, first_rank)

    def set_receive_plans(self, plans):
        self._ask("plan", plans[0]).result()

    def leave_transfer(self):
        self._ask("leave").result()

    def start_receive_weights(self, sync, verify=False):
        from megarl.rollout.protocol import Deferred

        call = self._ask("receive", sync, verify)

        def result():
            out = call.result()
            self.got = out["metrics"].pop("got")  # what this host's workers hold
            self.received = out["received"]
            return [out]
        return Deferred(result)

    def shutdown(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
