"""The trainer's side of the sync plan: what every rank holds of the model, as the bridge mapping names and splits it.

    holdings = model_holdings(chunks, spec)        # a collective, once per run (megarl.sync.factory builds it)
    holdings.boxes                                  # {hf name: [(rank, box)]}: where plan_moves takes each piece from
    holdings.cuts(moves)                            # where this rank's pieces lie in its parameters (compiled)

Every transport that moves the trainer's own shards (the colocated delivery, megarl.sync.transports.colocated; engines
hosted elsewhere, megarl.sync.transports.remote) plans from the same holdings and cuts its pieces with the same calls,
so the mapping and the walk over the model's parameters happen once per run, whichever transport runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from megarl.bridge.mapping import Mapping
from megarl.distributed import all_gather_objects
from megarl.sync.copies import compile_cuts
from megarl.sync.shards import trainer_holdings


@dataclass
class Holdings:
    """mapping: the model's bridge mapping; local: this rank's {megatron name: LocalParam}; owners: every rank's
    {megatron name: [(rank, tp rank, tp size)]}; dtypes: {megatron name: dtype name} over every rank."""

    mapping: Mapping
    local: dict
    owners: dict
    dtypes: dict

    @cached_property
    def hf_dtypes(self) -> dict:
        """{hf name: dtype name} of every tensor some rank holds."""
        return {h: self.dtypes[e.megatron] for e in self.mapping.entries if e.megatron in self.dtypes for h in e.hf}

    @cached_property
    def element_sizes(self) -> dict:
        """{hf name: bytes per element}."""
        return {h: torch.empty((), dtype=getattr(torch, dt)).element_size() for h, dt in self.hf_dtypes.items()}

    @cached_property
    def boxes(self) -> dict:
        """{hf name: [(rank, box)]}: the HF chunks each trainer rank holds (megarl.sync.shards.trainer_holdings)."""
        return trainer_holdings(self.mapping, self.owners)

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (the CPU where it holds none)."""
        return next((lp.param.device for lp in self.local.values()), torch.device("cpu"))

    def cuts(self, moves) -> dict:
        """{(hf name, box): Cut} of moves whose pieces this rank cuts from its own parameters (megarl.sync.copies):
        compiled once, when a transport is planned, so that an update never asks the mapping again."""
        pieces = []
        for mv in moves:
            entry = self.mapping.by_hf[mv.hf]
            lp = self.local[entry.megatron]
            split = entry.tp_dim is not None and lp.tp_size > 1
            pieces.append((mv.hf, mv.box, mv.holding, entry, tuple(lp.param.shape), lp.tp_rank if split else 0,
                           lp.tp_size if split else 1))
        return compile_cuts(self.mapping, pieces)


def model_holdings(chunks, spec) -> Holdings:
    """The mapping of a model built by megarl.megatron.model and every rank's holdings of it (a collective)."""
    from megarl.bridge.importer import model_mapping

    mapping = model_mapping(chunks, spec)
    return gather_holdings(mapping, *local_holdings(chunks, mapping))


def gather_holdings(mapping: Mapping, local: dict, tp_info: dict, dtypes: dict) -> Holdings:
    """Holdings from this rank's parameters as `local_holdings` returns them, every rank's gathered (a collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {name: (rank,) + tp_info[name] for name in local}
    owners: dict = {}
    all_dtypes: dict = {}
    for per_rank, dts in all_gather_objects((mine, dtypes)):
        for name, owner in per_rank.items():
            owners.setdefault(name, []).append(owner)
        all_dtypes.update(dts)
    return Holdings(mapping, local, owners, all_dtypes)


def local_holdings(model, mapping: Mapping) -> tuple:
    """This rank's parameters by megatron name, their (tp rank, tp size) as the mapping splits them, and dtypes."""
    from megarl.bridge.sharding import local_params

    local, tp_info, dtypes = {}, {}, {}
    for lp in local_params(model):
        entry = mapping.entry(lp.name)
        if entry.megatron in local:
            continue
        split = entry.tp_dim is not None and lp.tp_size > 1
        local[entry.megatron] = lp
        tp_info[entry.megatron] = (lp.tp_rank if split else 0, lp.tp_size if split else 1)
        dtypes[entry.megatron] = str(lp.param.dtype).replace("torch.", "")
    return local, tp_info, dtypes
