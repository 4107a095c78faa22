"""Rollout engines as Ray actors (rollout.mode = "ray"), behind the methods of VLLMEngine / EngineProcess.

Layout
* rollout.data_parallel_size replicas, each one Ray actor hosting a VLLMEngine with engine TP =
  rollout.tensor_model_parallel_size (vLLM runs its TP group inside the actor). Every replica is one bundle of a
  placement group ({"CPU": 1, "GPU": engine TP} on GPU, {"CPU": 1} on CPU), so a replica's TP group stays on one
  node and the replicas are packed onto the Ray cluster's nodes. The Ray cluster is whatever RAY_ADDRESS names
  (engines on their own nodes, started with `ray start`); without it the trainer's rank 0 starts a local Ray
  instance itself (`ray.init(num_cpus=..., include_dashboard=False)`) and stops it on shutdown.
* generate: the prompts are split into contiguous chunks, one per replica, generated concurrently and concatenated
  in prompt order. Seeds follow VLLMEngine's rule (prompt i's samples use seed + i*n + j) with the global prompt
  index, so the samples do not depend on the number of replicas.
* weights: never through Ray's object store. Each actor joins the trainer's transfer group (megarl.sync.transfer)
  and receives, after every update, exactly its workers' shards straight from the trainer ranks that hold them (gloo
  on CPU, NCCL on GPU); it writes them into its workers' shared-memory bucket files and loads them through megarl's
  worker extension, as a colocated engine does.

Why the dist variables are removed: a Ray instance started by the trainer's rank 0 inherits its environment, and an
engine that saw RANK/WORLD_SIZE/MASTER_ADDR would try to join the trainer's process group (see process.py).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence

import torch

from megarl import lifecycle
from megarl.agent.loop import COUNT_KEYS as TOOL_COUNT_KEYS, tool_rates
from megarl.config.schema import RolloutConfig
from megarl.layout import EngineDevices
from megarl.rollout.hosting.process import _DIST_VARS, EngineProcessError
from megarl.rollout.protocol import Deferred
from megarl.types import RolloutBatch

log = logging.getLogger(__name__)


class RayEngineError(EngineProcessError):
    """A Ray-hosted engine failed to start or to run a call; the message names the replica and the cause."""


# ----------------------------------------------------------------------------------------------------------------------
# Pure helpers


def split_prompts(num_prompts: int, replicas: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) chunks of num_prompts over replicas, sizes differing by at most one (empty chunks
    are dropped)."""
    base, extra = divmod(num_prompts, replicas)
    out, start = [], 0
    for r in range(replicas):
        stop = start + base + (1 if r < extra else 0)
        if stop > start:
            out.append((start, stop))
        start = stop
    return out


def concat_rollouts(parts: Sequence[RolloutBatch]) -> RolloutBatch:
    """One RolloutBatch from the replicas' parts (rows in order), with metrics of the whole: counts summed, time the
    longest part's (the replicas run concurrently), the oldest weight version."""
    if len(parts) == 1:
        return parts[0]
    out = RolloutBatch.concat(list(parts))
    seconds = max(p.metrics.get("rollout/generate_seconds", 0.0) for p in parts)
    metrics: dict[str, float] = {}
    for key in ("rollout/num_prompts", "rollout/num_samples", "rollout/prompts_truncated", "rollout/prompts_filtered",
                "rollout/response_tokens"):
        metrics[key] = float(sum(p.metrics.get(key, 0.0) for p in parts))
    n = len(out)
    metrics["rollout/response_length_mean"] = float(out.response_lengths.float().mean()) if n else 0.0
    metrics["rollout/truncated_fraction"] = float(out.truncated.float().mean()) if n else 0.0
    metrics["rollout/generate_seconds"] = seconds
    metrics["rollout/tokens_per_second"] = metrics["rollout/response_tokens"] / seconds if seconds > 0 else 0.0
    metrics["rollout/engine_replicas"] = float(len(parts))
    tool_counts = {k: float(sum(p.metrics.get(k, 0.0) for p in parts)) for k in TOOL_COUNT_KEYS
                   if any(k in p.metrics for p in parts)}
    if tool_counts:
        metrics.update({**tool_counts, **tool_rates(tool_counts)})
    out.metrics = metrics
    out.weight_version = min(p.weight_version for p in parts)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The actor


class _EngineHost:
    """Runs inside a Ray actor: one VLLMEngine, which receives its weights over the transfer group. Not used
    directly; see RayEngine."""

    def __init__(self, config: RolloutConfig, model_path: str, seed: int, prompt_overflow: str,
                 expected: Optional[EngineDevices] = None):
        for key in _DIST_VARS:
            os.environ.pop(key, None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from megarl.rollout.vllm.engine import VLLMEngine

        where = ""
        if expected is not None:  # Ray chose the node and the GPUs: as many as the layout gives the replica?
            import ray

            expected.check_assigned(ray.get_gpu_ids())
            where = (f"replica {expected.replica}: Ray node {ray.util.get_node_ip_address()}, GPUs "
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}")
        self.engine = VLLMEngine(config, model_path, seed=seed, prompt_overflow=prompt_overflow, where=where)

    def ready(self) -> float:
        return float(self.engine.start_seconds)

    def generate(self, prompt_token_ids, **kwargs) -> RolloutBatch:
        return self.engine.generate(prompt_token_ids, **kwargs)

    def rollout_agents(self, prompt_token_ids, **kwargs) -> RolloutBatch:
        return self.engine.rollout_agents(prompt_token_ids, **kwargs)

    # -- weights over the transfer group (megarl.sync.transports.remote) -----------------------------------------------
    def layouts(self) -> list:
        return self.engine.layouts

    def join_transfer(self, spec, rank: int) -> None:
        self.engine.join_transfer(spec, rank)

    def set_receive_plan(self, plan) -> None:
        self.engine.set_receive_plan(plan)

    def leave_transfer(self) -> None:
        self.engine.leave_transfer()

    def receive_weights(self, sync: int, verify: bool) -> dict:
        return self.engine.receive_weights(sync, verify)

    # -- the rest of the engine interface ---------------------------------------------------------------------------
    def weight_version(self) -> int:
        return self.engine.weight_version

    def checksums(self):
        return self.engine.checksums()

    def expected_checksums(self, hf_checksums):
        return self.engine.expected_checksums(hf_checksums)

    def verify_weights(self, expected, rtol: float):
        return self.engine.verify_weights(expected, rtol=rtol)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags=None) -> None:
        self.engine.wake_up(tags)

    def abort(self) -> None:
        self.engine.abort()

    def shutdown(self) -> None:
        self.engine.shutdown()


# ----------------------------------------------------------------------------------------------------------------------
# The driver side


class RayEngine:
    """rollout.data_parallel_size VLLMEngine replicas in Ray actors; the methods of VLLMEngine.

    Args:
        config, model_path, seed, prompt_overflow: as VLLMEngine.
        address: a Ray cluster to join (default: $RAY_ADDRESS); None and no RAY_ADDRESS: start a local Ray instance.
        num_cpus: CPUs of a local Ray instance (default: one per replica).
        start_timeout_s: how long the engines may take to start.
        devices: each replica's GPUs as the layout gives them (MegarlConfig.engine_devices; GPU runs): Ray places
            num_gpus of one node for each, and each actor checks what Ray gave it. None: engine TP GPUs each on GPU.
    """

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 address: Optional[str] = None, num_cpus: Optional[int] = None, start_timeout_s: float = 600,
                 devices: Optional[Sequence[EngineDevices]] = None):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.config = config
        self.replicas = int(config.data_parallel_size or 1)
        self._started_ray = False
        self._actors: list = []
        self._pg = None
        self._remove_pg = remove_placement_group
        on_gpu = torch.cuda.is_available()
        if devices is None:
            devices = [None] * self.replicas
            gpus = [int(config.tensor_model_parallel_size) if on_gpu else 0] * self.replicas
        else:
            gpus = [d.num_gpus for d in devices]
        address = address or os.environ.get("RAY_ADDRESS") or None

        t0 = time.perf_counter()
        try:
            if not ray.is_initialized():
                saved = {k: os.environ.pop(k) for k in _DIST_VARS if k in os.environ}
                try:
                    if address:
                        ray.init(address=address, namespace="megarl", log_to_driver=True)
                    else:
                        ray.init(num_cpus=num_cpus or self.replicas, num_gpus=sum(gpus) or None,
                                 include_dashboard=False, namespace="megarl", log_to_driver=True)
                    self._started_ray = True
                finally:
                    os.environ.update(saved)
            bundles = [{"CPU": 1, **({"GPU": g} if g else {})} for g in gpus]
            self._pg = placement_group(bundles, strategy="PACK", name=f"megarl-engines-{os.getpid()}")
            if not self._wait(self._pg.ready(), start_timeout_s):
                raise RayEngineError(f"Ray could not place {self.replicas} engine replica(s) of {bundles[0]} within "
                                     f"{start_timeout_s:.0f} s; the cluster has {ray.cluster_resources()}. Fix: add "
                                     "nodes to the Ray cluster or lower rollout.data_parallel_size / "
                                     f"rollout.tensor_model_parallel_size. {lifecycle.see('engine-ray-placement')}")
            host = ray.remote(_EngineHost)
            runtime_env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if not on_gpu else
                                        os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")}}
            for r in range(self.replicas):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                            placement_group_bundle_index=r)
                self._actors.append(host.options(
                    num_cpus=1, num_gpus=gpus[r], scheduling_strategy=strategy, runtime_env=runtime_env,
                    name=f"megarl-engine-{os.getpid()}-{r}",
                    # two threads: abort() must run while generate() does; the driver makes every other call in turn
                    max_concurrency=2,
                ).remote(config, str(model_path), int(seed), prompt_overflow, devices[r]))
            starts = self._get([a.ready.remote() for a in self._actors], start_timeout_s, "start")
        except BaseException:
            self.shutdown()
            raise
        log.info("Ray rollout engines: %d replica(s) of engine TP%d started in %.1fs (engine start %s s)",
                 self.replicas, config.tensor_model_parallel_size, time.perf_counter() - t0,
                 ", ".join(f"{s:.1f}" for s in starts))

    # -- plumbing -----------------------------------------------------------------------------------------------------
    def _wait(self, ref, timeout_s: float) -> bool:
        ready, _ = self._ray.wait([ref], timeout=timeout_s)
        return bool(ready)

    def _get(self, refs, timeout_s: Optional[float], what: str):
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return self._ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            late = f"the Ray-hosted vLLM engine(s) did not {what} within {timeout_s:.0f} s"
            raise RayEngineError(late + (f" {lifecycle.see('engine-start-timeout')}" if what == "start" else "")) \
                from None
        except (RayTaskError, RayActorError) as exc:
            raise RayEngineError(f"the Ray-hosted vLLM engine failed to {what}: {exc}") from None

    def _all(self, method: str, *args, timeout_s: Optional[float] = None):
        return self._get([getattr(a, method).remote(*args) for a in self._actors], timeout_s, method)

    # -- the engine interface -----------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None, validate: bool = False,
                 prompt_index: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 greedy: bool = False) -> RolloutBatch:
        prompts = [list(p) for p in prompt_token_ids]
        ids = list(range(len(prompts))) if prompt_index is None else [int(i) for i in prompt_index]
        src = self.config.val_kwargs if validate else self.config
        n_eff = 1 if greedy else n if n is not None else src.n
        return self._split_call("generate", prompts, ids, n_eff, seed, n=n, validate=validate, greedy=greedy)

    def rollout_agents(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None,
                       validate: bool = False, prompt_index: Optional[Sequence[int]] = None,
                       seed: Optional[int] = None, extra_infos: Optional[Sequence] = None) -> RolloutBatch:
        """Multi-turn rollouts (VLLMEngine.rollout_agents), each replica running the agent loop for its prompts."""
        prompts = [list(p) for p in prompt_token_ids]
        ids = list(range(len(prompts))) if prompt_index is None else [int(i) for i in prompt_index]
        n_eff = n if n is not None else (self.config.val_kwargs if validate else self.config).n
        return self._split_call("rollout_agents", prompts, ids, n_eff, seed, n=n, validate=validate,
                                per_prompt={"extra_infos": extra_infos})

    def _split_call(self, method: str, prompts: list, ids: list, n_eff: int, seed: Optional[int],
                    per_prompt: Optional[dict] = None, **kwargs) -> RolloutBatch:
        chunks = split_prompts(len(prompts), len(self._actors)) or [(0, 0)]
        refs = []
        for actor, (start, stop) in zip(self._actors, chunks):
            chunk_seed = None if seed is None else int(seed) + start * n_eff  # the colocated engine's seeds
            extra = {k: None if v is None else list(v[start:stop]) for k, v in (per_prompt or {}).items()}
            refs.append(getattr(actor, method).remote(prompts[start:stop], prompt_index=ids[start:stop],
                                                      seed=chunk_seed, **kwargs, **extra))
        return concat_rollouts(self._get(refs, None, method))

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> Deferred:
        """As generate (Ray engines generate only in trainer.mode=sync: the call returns when it is done)."""
        return Deferred.ready(self.generate(prompt_token_ids, **kwargs))

    # -- weights over the transfer group: one engine host per replica (megarl.sync.transports.remote) ------------------
    def transfer_layouts(self) -> list:
        return self._all("layouts")

    def start_join_transfer(self, spec, first_rank: int):
        refs = [a.join_transfer.remote(spec, first_rank + i) for i, a in enumerate(self._actors)]
        return Deferred(lambda: self._get(refs, None, "join the weight transfer group"))

    def set_receive_plans(self, plans: list) -> None:
        self._get([a.set_receive_plan.remote(p) for a, p in zip(self._actors, plans)], None, "take the receive plan")

    def leave_transfer(self) -> None:
        self._get([a.leave_transfer.remote() for a in self._actors], None, "leave the weight transfer group")

    def start_receive_weights(self, sync: int, verify: bool = False):
        refs = [a.receive_weights.remote(sync, verify) for a in self._actors]
        return Deferred(lambda: self._get(refs, None, "receive weights"))

    @property
    def weight_version(self) -> int:
        return min(self._all("weight_version"))

    def checksums(self):
        return self._get(self._actors[0].checksums.remote(), None, "checksum weights")

    def expected_checksums(self, hf_checksums):
        return self._get(self._actors[0].expected_checksums.remote(hf_checksums), None, "checksum weights")

    def verify_weights(self, expected, rtol: float = 1e-9) -> dict:
        """Every replica's report merged: ok only if every replica holds the expected weights."""
        reports = self._all("verify_weights", expected, rtol)
        merged = dict(reports[0])
        merged["ok"] = all(r["ok"] for r in reports)
        merged["mismatched"] = sorted({n for r in reports for n in r["mismatched"]})
        merged["missing_in_engine"] = sorted({n for r in reports for n in r["missing_in_engine"]})
        return merged

    @property
    def sleeps(self) -> bool:
        """False: Ray actors hold resources of their own (placement separate), there is nothing to make room for."""
        return False

    def sleep(self) -> None:
        self._all("sleep")

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        self._all("wake_up", tags)

    def abort(self) -> None:
        """End the requests in flight on every replica; a running generate returns what was generated so far."""
        self._all("abort")

    def shutdown(self, timeout_s: float = 30) -> None:
        ray = self._ray
        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=timeout_s)
            except Exception:  # noqa: BLE001 - best effort; the actors are killed next
                pass
            for a in actors:
                try:
                    ray.kill(a)
                except Exception:  # noqa: BLE001
                    pass
        if self._pg is not None and ray.is_initialized():
            try:
                self._remove_pg(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def __del__(self):  # best effort: never leave engines or a local Ray instance behind
        try:
            if getattr(self, "_actors", None) or getattr(self, "_started_ray", False):
                self.shutdown()
        except Exception:  # noqa: BLE001
            pass
