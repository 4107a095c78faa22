"""The weight sync of a run, built in one place: the bridge mapping and the trainer's holdings (megarl.sync.holdings)
once, handed to the transport the recipe picks; the only place that reads the recipe's sync settings.

    factory = SyncFactory(actor.chunks, spec)                  # every rank, once per run
    sync = factory.for_recipe(cfg, engine, topology)           # a collective: planned once (again after a restart)
    metrics = sync.run(engine)                                 # every update

Transports (megarl.sync.transports, one file each):
* colocated: engines on the trainer's ranks; each worker's pieces reach it through bucket files, writes into its
  parameters (megarl.sync.placement) or its own pulls from the host's memory (megarl.sync.pull), as each worker
  reports at plan time.
* remote: engines in processes of their own (Ray actors, rollout.placement=separate).
* adapter: only the LoRA adapters after each update; an engine started with dummy weights first gets the base once
  through the colocated transport.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.layout import EngineTopology
from megarl.sync.holdings import Holdings, model_holdings
from megarl.sync.transports.remote_delta import DeltaSettings

COLOCATED, REMOTE, ADAPTER = "colocated", "remote", "adapter"


def transport_of(cfg) -> str:
    """The transport a recipe (a MegarlConfig) picks: adapters alone with actor.lora.sync=adapter, remote with the
    engines placed apart from the trainer, colocated otherwise."""
    if cfg.actor.lora.enabled and cfg.actor.lora.sync == "adapter":  # the engine keeps its base; adapters only
        return ADAPTER
    return REMOTE if cfg.engine_placement == "separate" else COLOCATED


class SyncFactory:
    """Builds the transports of one model over one Holdings, made on first need (a collective) and kept: a second
    transport of the same model (a benchmark comparing them, the adapter sync's base) plans from the same one."""

    def __init__(self, chunks, spec):
        self.chunks, self.spec = chunks, spec
        self._holdings: Optional[Holdings] = None

    @property
    def holdings(self) -> Holdings:
        if self._holdings is None:
            self._holdings = model_holdings(self.chunks, self.spec)
        return self._holdings

    def colocated(self, engine: Any, topology: EngineTopology, bucket_bytes: int):
        from megarl.sync.transports.colocated import plan_sync

        return plan_sync(self.holdings, engine, topology, bucket_bytes)

    def remote(self, engine: Any, bucket_bytes: int, **kwargs):
        """kwargs: plan_remote_sync's (timeout_s, engine_dtype, delta)."""
        from megarl.sync.transports.remote import plan_remote_sync

        return plan_remote_sync(self.holdings, engine, bucket_bytes, **kwargs)

    def adapters(self, engine: Any, topology: EngineTopology, bucket_bytes: int, engine_dtype: torch.dtype,
                 base_weights: bool = False):
        """base_weights: the engine started with dummy weights and gets the base once, through the colocated
        transport, before the first adapter (the holdings are built only then)."""
        from megarl.sync.transports.adapter import AdapterSync

        base = self.colocated(engine, topology, bucket_bytes) if base_weights else None
        return AdapterSync(self.chunks, topology, engine_dtype, base=base)

    def for_recipe(self, cfg, engine: Any, topology: EngineTopology):
        """The transport a recipe (a MegarlConfig) picks, with its settings (a collective)."""
        # an engine started with dummy weights gets the base once, through the ordinary plan, before the first adapter
        return self.build(transport_of(cfg), engine, topology, cfg.rollout.update_weights_bucket_megabytes << 20,
                          engine_dtype(cfg), base_weights=cfg.rollout.load_format == "dummy", delta=delta_settings(cfg))

    def build(self, transport: str, engine: Any, topology: EngineTopology, bucket_bytes: int,
              engine_dtype: Optional[torch.dtype] = None, base_weights: bool = False,
              delta: Optional[DeltaSettings] = None):
        if transport == ADAPTER:
            if engine_dtype is None:
                raise ValueError("the adapter sync needs the engine's dtype (the adapters are sent in it)")
            return self.adapters(engine, topology, bucket_bytes, engine_dtype, base_weights)
        if transport == REMOTE:
            name = str(engine_dtype).replace("torch.", "") if engine_dtype is not None else None
            return self.remote(engine, bucket_bytes, engine_dtype=name, delta=delta)
        if transport == COLOCATED:
            return self.colocated(engine, topology, bucket_bytes)
        raise ValueError(f"weight sync transport {transport!r}: expected one of {COLOCATED}, {REMOTE}, {ADAPTER}")


def engine_dtype(cfg) -> Optional[torch.dtype]:
    """The dtype adapters and weights over the network travel in (the engine's); None for the colocated transport,
    whose pieces keep the trainer's dtype."""
    if transport_of(cfg) == COLOCATED:
        return None
    from megarl.distributed import compute_device

    return getattr(torch, cfg.rollout.resolved_dtype(compute_device().type == "cuda"))


def delta_settings(cfg) -> Optional[DeltaSettings]:
    """The delta updates a recipe asks for (rollout.delta_*; None: every update whole). rollout.delta_updates=None
    resolves by the engine's dtype: on for 16-bit engines, off for float32 ones."""
    from megarl.distributed import compute_device

    r = cfg.rollout
    if not r.resolved_delta_updates(compute_device().type == "cuda"):
        return None
    return DeltaSettings(r.delta_full_every, r.delta_kept_on, r.delta_verify_every, r.delta_verify_sample)


def build_sync(chunks, spec, engine: Any, topology: EngineTopology, bucket_bytes: int, transport: str = COLOCATED,
               engine_dtype: Optional[torch.dtype] = None, base_weights: bool = False,
               delta: Optional[DeltaSettings] = None):
    """The live weight sync of a model, planned once (a collective of every trainer rank): `engine` is this rank's
    engine handle if it owns a replica (or hosts, for remote), else None. Returns the transport; its `run(engine)`
    delivers the current weights. Remote only: floating-point pieces travel in `engine_dtype`, and with `delta`
    only changed elements travel between full updates (megarl.sync.delta)."""
    return SyncFactory(chunks, spec).build(transport, engine, topology, bucket_bytes, engine_dtype, base_weights,
                                           delta)
