"""The trainer's side of delta updates to engine hosts (megarl.sync.transports.remote with rollout.delta_updates;
the formats are megarl.sync.delta's): which hosts get the next update whole, the copy of what was last sent of each
piece and the diff beside it, and the checks after an update.

Per host, an update is whole (every piece DENSE, no diff computed) when the host is fresh (the first update; after it
restarted or was lost: its mirror is gone), every `full_every` updates of that host, and after a delta update that
took no fewer bytes than a whole one would have (headers included, over every sending rank: the diff did not pay;
the update after the whole one tries again); else each piece travels in the format of the fewest bytes, which is
DENSE where the changes would take more. Checks after a delta update:
* every piece's bit checksum as the trainer keeps it against the host's mirror (both decoded the same bytes);
* the engine workers' memory read back after they loaded the update (the engine's verify, comparing each engine
  tensor as its kernels read it with what the worker received from the mirror): the tensors of `verify_sample` HF
  names each update, in turn, and all of them every `verify_every` updates.
Together they tie what the engine computes with to what the trainer sent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.sync.delta import ENTRY, KINDS, SAME, checksum, encode
from megarl.sync.transfer import piece_key


@dataclass(frozen=True)
class DeltaSettings:
    """rollout.delta_full_every, rollout.delta_kept_on ("host": host memory, pinned on GPU; "device": beside the
    parameters, the diff on the GPU), rollout.delta_verify_every and rollout.delta_verify_sample."""

    full_every: int = 10
    kept_on: str = "host"
    verify_every: int = 10
    verify_sample: int = 4


class DeltaSender:
    """One trainer rank's kept copies and per-host state (the same decisions on every rank: they depend only on the
    sync number and on which hosts were fresh, which the ranks agree on)."""

    def __init__(self, settings: DeltaSettings, host_ranks: list, names: list):
        self.settings = settings
        self.hosts = list(host_ranks)
        self.names = sorted(names)  # HF names the plan sends, for the read-back sample
        self.kept: dict = {}  # {(bucket, index in bucket): the piece as last sent}
        self.fresh = set(self.hosts)  # hosts whose next update is whole: the first update goes whole everywhere
        self.since_full = {h: 0 for h in self.hosts}
        self.kinds = [0] * len(KINDS)  # pieces of this rank's current update by format
        self.unpaid: set = set()  # hosts whose last delta update took no fewer bytes than a whole one
        self.bytes: dict = {}  # {host: [bytes sent as a delta, bytes whole]} of this rank's current update

    def full_hosts(self) -> set:
        """The hosts this update goes whole to (call once at the start of every update)."""
        full = {h for h in self.hosts if h in self.fresh or h in self.unpaid
                or self.since_full[h] + 1 >= self.settings.full_every}
        for h in self.hosts:
            self.since_full[h] = 0 if h in full else self.since_full[h] + 1
        self.fresh.clear()
        self.unpaid.clear()
        self.kinds = [0] * len(KINDS)
        self.bytes = {}
        return full

    def mark_fresh(self, hosts) -> None:
        """These hosts lost their mirrors (restarted, lost, or in an unknown state): their next update is whole."""
        self.fresh.update(hosts)

    def encode(self, key: tuple, piece: torch.Tensor, full: bool, host: int = -1) -> tuple:
        """(header entry, tensors to send from the piece's device) of a contiguous piece for `host`, and the kept
        copy brought to it (a copy in place after the first time, whatever the format: the host's decoding is checked
        against it). The diff runs where the kept copy lives."""
        where = torch.device("cpu") if self.settings.kept_on == "host" else piece.device
        here = piece if piece.device == where else piece.to(where)
        last = self.kept.get(key)
        entry, tensors = encode(here, None if full else last)
        if last is None:
            pinned = where.type == "cpu" and piece.device.type == "cuda"
            last = self.kept[key] = torch.empty(here.shape, dtype=here.dtype, device=where, pin_memory=pinned)
        if entry[0] != SAME:  # whatever the format, what was sent decodes to the piece: a plain copy of it
            last.copy_(here)
        self.kinds[entry[0]] += 1
        if not full:
            sent = self.bytes.setdefault(host, [0, 0])
            sent[0] += sum(t.numel() * t.element_size() for t in tensors) + ENTRY * 8  # and its header entry
            sent[1] += piece.numel() * piece.element_size()
        return entry, [t if t.device == piece.device else t.to(piece.device) for t in tensors]

    def worker_check(self, sync: int, verify: bool):
        """What the engine workers read back after they load update `sync`: True (every tensor) with verify or every
        verify_every updates, else verify_sample HF names in turn (a list), or False."""
        s = self.settings
        if verify or (s.verify_every and sync % s.verify_every == 0):
            return True
        if not s.verify_sample or not self.names:
            return False
        n = len(self.names)
        return [self.names[(sync * s.verify_sample + i) % n] for i in range(min(s.verify_sample, n))]

    def report(self, buckets: list, rank: int, changed: int) -> tuple:
        """What this rank contributes to the check of an update (gathered by the caller with the hosts' results):
        (elements changed, {piece key: checksum of the kept copy}, pieces by format, kept bytes, bytes per host)."""
        sums = {piece_key(b, mv): checksum(self.kept[(b, j)]) for b, moves in enumerate(buckets)
                for j, mv in enumerate(moves) if mv.src == rank}
        kept = sum(t.numel() * t.element_size() for t in self.kept.values())
        return changed, sums, self.kinds, kept, self.bytes

    def check(self, sync: int, reports: list, results: list) -> dict:
        """Every piece's checksum as the ranks keep it (reports[rank]: `report`'s) against the hosts' mirrors that
        their workers loaded (results[rank]: the results of that rank's hosts): a delta update must leave the engine
        exactly as a full one would. The same on every rank (it sees what every rank gathered)."""
        expected = {k: v for e in reports for k, v in e[1].items()}
        held = {k: v for hosts in results for r in hosts for k, v in r["sums"].items()}
        wrong = sorted({k[1] for k, v in expected.items() if held.get(k) != v})
        if wrong:
            self.mark_fresh(self.hosts)
            raise RuntimeError(f"delta weight update {sync}: the engine's copy of {len(wrong)} tensors differs "
                               f"from what the trainer sent (e.g. {wrong[:3]}); set rollout.delta_updates=false and "
                               f"resume from the last checkpoint")
        per_host: dict = {}
        for e in reports:
            for h, (delta, whole) in e[4].items():
                total = per_host.setdefault(h, [0, 0])
                total[0], total[1] = total[0] + delta, total[1] + whole
        self.unpaid = {h for h, (delta, whole) in per_host.items() if delta >= whole}
        out = {"weight_sync/changed_elements": float(sum(e[0] for e in reports)),
               "weight_sync/delta_unpaid_hosts": float(len(self.unpaid)),
               "weight_sync/checked_pieces": float(len(expected)),
               "weight_sync/delta_kept_bytes_max": float(max(e[3] for e in reports))}
        for i, kind in enumerate(KINDS):
            out[f"weight_sync/pieces_{kind}"] = float(sum(e[2][i] for e in reports))
        return out
