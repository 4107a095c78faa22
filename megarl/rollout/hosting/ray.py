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

Lost replicas (rollout.on_engine_failure=restart, the default): every generation and weight receive is watched per
actor. An actor is lost when it dies (Ray reports the actor dead), stops answering the watchdog's ping for
rollout.health.timeout_s (a stopped or frozen process), reports a stalled decode (the stall limit of
megarl.rollout.health, judged inside the actor by its own clock), or a call fails with an error a restart cures (an
OOM in the engine, a dead worker: megarl.rollout.hosting.process.curable). The other actors' calls are waited for and
their samples kept; `EngineLost` goes up to megarl.steps' EngineGeneration, which (on every rank alike) calls
`kill` and `restart` here, re-forms the transfer group (the restarted actors fresh, the others keep their delta
mirrors) and asks for the same prompts again: only the lost actors' chunks are generated again (the same seeds).
The new actor takes the lost one's bundle of the placement group, so it lands where the layout put the replica.

Why the dist variables are removed: a Ray instance started by the trainer's rank 0 inherits its environment, and an
engine that saw RANK/WORLD_SIZE/MASTER_ADDR would try to join the trainer's process group (see process.py).
"""
from __future__ import annotations

import logging
import signal
import os
import time
from typing import Optional, Sequence

import torch

from megarl import lifecycle
from megarl.agent.loop import COUNT_KEYS as TOOL_COUNT_KEYS, tool_rates
from megarl.config.schema import RolloutConfig
from megarl.layout import EngineDevices
from megarl.rollout.health import EngineHealth, HealthSettings
from megarl.rollout.hosting.process import _DIST_VARS, EngineProcessError, curable
from megarl.rollout.hosting.supervisor import (HANG_AT_GENERATION, KILL_AT_GENERATION, KILL_AT_UPDATE,
                                               OOM_AT_GENERATION, STOP_AT_GENERATION, EngineLost, hook_hits)
from megarl.rollout.protocol import Deferred
from megarl.types import RolloutBatch

log = logging.getLogger(__name__)


class RayEngineError(EngineProcessError):
    """A Ray-hosted engine failed to start or to run a call; the message names the replica and the cause."""


class RayReplicasLost(RayEngineError):
    """Ray-hosted replicas were lost during a weight receive; `hosts`: their positions among the actors."""

    def __init__(self, message: str, hosts: Sequence[int]):
        super().__init__(message)
        self.hosts = tuple(hosts)


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


def ray_placement(replica: int, ip: str, node_id: str, gpu_ids: Sequence) -> str:
    """'replica 1: Ray node 10.0.0.7 (id 3f2a1b9c), GPUs 2,3' (no GPUs: 'no GPU (CPU engine)'): where Ray placed an
    engine replica, for its start line. The node id tells apart nodes that share an address (two Ray nodes started on
    one machine)."""
    gpus = f"GPUs {','.join(str(g) for g in gpu_ids)}" if gpu_ids else "no GPU (CPU engine)"
    return f"replica {replica}: Ray node {ip} (id {node_id[:8]}), {gpus}"


# ----------------------------------------------------------------------------------------------------------------------
# The actor


class _EngineHost:
    """Runs inside a Ray actor: one VLLMEngine, which receives its weights over the transfer group. Not used
    directly; see RayEngine."""

    def __init__(self, config: RolloutConfig, model_path: str, seed: int, prompt_overflow: str,
                 expected: Optional[EngineDevices] = None, health: Optional[HealthSettings] = None,
                 replica: int = 0):
        import multiprocessing

        import ray

        for key in _DIST_VARS:
            os.environ.pop(key, None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from megarl.rollout.vllm.engine import VLLMEngine

        if expected is not None:  # Ray chose the node and the GPUs: as many as the layout gives the replica?
            expected.check_assigned(ray.get_gpu_ids())
        node_id = ray.get_runtime_context().get_node_id()
        # the node's own address (`ray start --node-ip-address`), which this machine's address need not be
        address = next((n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == node_id),
                       ray.util.get_node_ip_address())
        self.where = where = ray_placement(replica, address, node_id, ray.get_gpu_ids())
        # the watchdog's record lives in the actor: the driver asks it (`health`) instead of reading shared memory,
        # since the actor may run on another node (another monotonic clock)
        self._health = EngineHealth(multiprocessing.get_context("spawn"), health) if health is not None else None
        self.engine = VLLMEngine(config, model_path, seed=seed, prompt_overflow=prompt_overflow, where=where,
                                 progress=self._health.progress if self._health is not None else None)
        if self._health is not None:
            self._health.start_beating()

    def ready(self) -> tuple:
        """(engine start seconds, the actor's pid, its node's address, where it runs: ray_placement)."""
        import ray

        return float(self.engine.start_seconds), os.getpid(), ray.util.get_node_ip_address(), self.where

    def _run(self, method: str, *args, **kwargs):
        if self._health is not None:
            self._health.busy(method)
        try:
            return getattr(self.engine, method)(*args, **kwargs)
        finally:
            if self._health is not None:
                self._health.idle()

    def generate(self, prompt_token_ids, **kwargs) -> RolloutBatch:
        return self._run("generate", prompt_token_ids, **kwargs)

    def rollout_agents(self, prompt_token_ids, **kwargs) -> RolloutBatch:
        return self._run("rollout_agents", prompt_token_ids, **kwargs)

    # -- the watchdog (run on the actor's second thread while a call runs on the first) ------------------------------
    def health(self) -> Optional[str]:
        """Why this engine counts as lost (megarl.rollout.health.verdict by this actor's clock), or None."""
        return self._health.check() if self._health is not None else None

    def inject_fault(self, kind: str) -> None:
        if self._health is None:
            raise RuntimeError("engine faults are injected through the watchdog: rollout.health.enable=false")
        self._health.inject(kind)

    def set_weight_version(self, version: int) -> None:
        self.engine.set_weight_version(version)

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
        return self._run("receive_weights", sync, verify)

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
    """rollout.data_parallel_size VLLMEngine replicas in Ray actors; the methods of VLLMEngine, and with `restartable`
    those of an engine supervisor (megarl.rollout.hosting.supervisor): lost actors raise EngineLost and are replaced
    by `kill` + `restart` (see the module docstring).

    Args:
        config, model_path, seed, prompt_overflow: as VLLMEngine.
        address: a Ray cluster to join (default: $RAY_ADDRESS); None and no RAY_ADDRESS: start a local Ray instance.
        num_cpus: CPUs of a local Ray instance (default: one per replica).
        start_timeout_s: how long the engines may take to start.
        devices: each replica's GPUs as the layout gives them (MegarlConfig.engine_devices; GPU runs): Ray places
            num_gpus of one node for each, and each actor checks what Ray gave it. None: engine TP GPUs each on GPU.
        restartable: a lost actor raises EngineLost for the caller to restart it (rollout.on_engine_failure=restart);
            False: RayEngineError, the run stops.
        reply_timeout_s: rollout.engine_timeout_s, an optional cap on one generation or weight receive.
    """

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 address: Optional[str] = None, num_cpus: Optional[int] = None, start_timeout_s: float = 600,
                 devices: Optional[Sequence[EngineDevices]] = None, restartable: bool = False,
                 reply_timeout_s: Optional[float] = None):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self._ray = ray
        self.config = config
        self.replicas = int(config.data_parallel_size or 1)
        self.restartable, self.reply_timeout_s, self.start_timeout_s = restartable, reply_timeout_s, start_timeout_s
        self._health = HealthSettings.of(config)
        self._started_ray = False
        self._actors: list = []
        # each actor's (pid, node address), for the test hooks and the kill of its tree (None: not started)
        self._pids: list = [None] * self.replicas
        self._joined: set = set()  # actors in the current transfer group
        self.lost: dict = {}  # {actor: cause} of the lost actors, until restart
        self.restarted_hosts: list = []  # the actors the last restart made fresh
        self._kept: Optional[tuple] = None  # (call key, {actor: part}): the survivors' parts of a call that lost actors
        self.generations = self.updates = 0  # calls counted for the test hooks
        self._pg = None
        self._remove_pg = remove_placement_group
        on_gpu = torch.cuda.is_available()
        if devices is None:
            devices = [None] * self.replicas
            gpus = [int(config.tensor_model_parallel_size) if on_gpu else 0] * self.replicas
        else:
            gpus = [d.num_gpus for d in devices]
        self._gpus, self._devices = gpus, list(devices)
        self._args = (config, str(model_path), int(seed), prompt_overflow)
        self._runtime_env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if not on_gpu else
                                          os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")}}
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
            self._actors = [self._new_actor(r) for r in range(self.replicas)]
            starts = self._started(range(self.replicas))
        except BaseException:
            self.shutdown()
            raise
        log.info("Ray rollout engines: %d replica(s) of engine TP%d started in %.1fs (engine start %s s)",
                 self.replicas, config.tensor_model_parallel_size, time.perf_counter() - t0,
                 ", ".join(f"{s:.1f}" for s in starts))

    def _new_actor(self, r: int):
        """Replica r's actor, in bundle r of the placement group (a restarted one lands where the lost one was)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=r)
        return self._ray.remote(_EngineHost).options(
            num_cpus=1, num_gpus=self._gpus[r], scheduling_strategy=strategy, runtime_env=self._runtime_env,
            name=f"megarl-engine-{os.getpid()}-{r}-{self.generations}-{self.updates}",
            # three threads: abort() and the watchdog's ping run while generate() does; the driver makes every other
            # call in turn
            max_concurrency=3,
        ).remote(*self._args, self._devices[r], self._health, r)

    def _started(self, replicas) -> list:
        """Wait for the actors `replicas` to start; their engine start seconds."""
        replicas = list(replicas)
        got = self._get([self._actors[r].ready.remote() for r in replicas], self.start_timeout_s, "start")
        for r, (_, pid, node, where) in zip(replicas, got):
            self._pids[r] = (pid, node)
            # the actors' own logs may not reach this process: name each replica's node and GPUs here
            log.info("Ray rollout engine %s", where)
        return [g[0] for g in got]

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

    def _watch(self, refs: dict, what: str) -> tuple:
        """Wait for each actor's call {actor: ref} under the watchdog: ({actor: value}, {actor: cause of its loss}).
        A call's error that a restart does not cure raises RayEngineError (the run stops)."""
        from ray.exceptions import RayActorError, RayTaskError

        ray, s = self._ray, self._health
        done, lost, pending, pings = {}, {}, dict(refs), {}
        start = time.monotonic()
        look = min(1.0, s.interval_s) if s is not None else 1.0
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=look)
            for r in [r for r, ref in pending.items() if ref in ready]:
                try:
                    done[r] = ray.get(pending.pop(r))
                except RayActorError as exc:
                    lost[r] = f"the Ray actor of replica {r} died ({_first_line(exc)})"
                except RayTaskError as exc:
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    if not curable(cause):
                        raise RayEngineError(f"the Ray-hosted vLLM engine of replica {r} failed to {what}: "
                                             f"{_first_line(exc)}") from None
                    lost[r] = f"an error a restart cures: {type(cause).__name__}: {_first_line(cause)}"
            now = time.monotonic()
            for r in list(pending):
                if self.reply_timeout_s is not None and now - start > self.reply_timeout_s:
                    lost[r] = (f"the Ray-hosted engine gave no reply for {now - start:.0f} s "
                               f"(rollout.engine_timeout_s): hung or stopped")
                elif s is not None:
                    cause = self._ping(r, pings, now)
                    if cause is not None:
                        lost[r] = cause
                if r in lost:
                    pending.pop(r)
        return done, lost

    def _ping(self, r: int, pings: dict, now: float) -> Optional[str]:
        """The watchdog's look at actor r (pings: {actor: (ref, sent at)} in flight): the cause of its loss, or None.
        A ping unanswered for rollout.health.timeout_s means the actor is stopped or frozen."""
        s = self._health
        if r not in pings:
            pings[r] = (self._actors[r].health.remote(), now)
            return None
        ref, sent = pings[r]
        ready, _ = self._ray.wait([ref], timeout=0)
        if ready:
            del pings[r]
            try:
                return self._ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died under the ping: its call's error follows
                return f"the Ray actor of replica {r} died ({_first_line(exc)})"
        if now - sent > s.timeout_s:
            return (f"no heartbeat from the Ray-hosted engine of replica {r} for {now - sent:.0f} s "
                    f"(rollout.health.timeout_s={s.timeout_s:g}): stopped or frozen")
        return None

    def _lose(self, lost: dict, when: str, kept_prompts: int = 0):
        """Record lost actors; the error the caller sees."""
        self.lost.update(lost)
        causes = "; ".join(f"replica {r}: {c}" for r, c in sorted(lost.items()))
        if self.restartable:
            return EngineLost(f"{when} ({causes})", kept=kept_prompts)
        return RayEngineError(f"Ray-hosted engine replica(s) {sorted(lost)} lost {when}: {causes} (rollout."
                              "on_engine_failure=fail; set it to restart to replace them)")

    # -- the engine interface -----------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> RolloutBatch:
        return self.start_generate(prompt_token_ids, **kwargs).result()

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None,
                       validate: bool = False, prompt_index: Optional[Sequence[int]] = None,
                       seed: Optional[int] = None, greedy: bool = False) -> Deferred:
        """Every replica starts on its chunk of the prompts; result() waits for them (under the watchdog)."""
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
                                per_prompt={"extra_infos": extra_infos}).result()

    def _split_call(self, method: str, prompts: list, ids: list, n_eff: int, seed: Optional[int],
                    per_prompt: Optional[dict] = None, **kwargs) -> Deferred:
        chunks = split_prompts(len(prompts), len(self._actors)) or [(0, 0)]
        # the same call again after a loss (the same prompts and seeds): the survivors' parts are kept
        key = repr((method, prompts, ids, n_eff, seed, per_prompt, sorted(kwargs.items())))
        kept = self._kept[1] if self._kept is not None and self._kept[0] == key else {}
        self._kept = None
        self._before_generation()
        refs = {}
        for r, (actor, (start, stop)) in enumerate(zip(self._actors, chunks)):
            if r in kept:
                continue
            chunk_seed = None if seed is None else int(seed) + start * n_eff  # the colocated engine's seeds
            extra = {k: None if v is None else list(v[start:stop]) for k, v in (per_prompt or {}).items()}
            refs[r] = getattr(actor, method).remote(prompts[start:stop], prompt_index=ids[start:stop],
                                                    seed=chunk_seed, **kwargs, **extra)
        self._after_generation_sent(refs)

        def wait() -> RolloutBatch:
            done, lost = self._watch(refs, method)
            parts = {**kept, **done}
            if lost:
                self._kept = (key, parts)
                raise self._lose(lost, "during generation",
                                 kept_prompts=sum(stop - start for r, (start, stop) in enumerate(chunks) if r in parts))
            return concat_rollouts([parts[r] for r in range(len(chunks))])

        return Deferred(wait)

    def _before_generation(self) -> None:
        """The watchdog's ping of every idle actor before new work, and the test hooks acting inside the next steps."""
        self.generations += 1
        if self._health is not None:
            verdicts, lost = self._watch({r: a.health.remote() for r, a in enumerate(self._actors)},
                                         "answer the watchdog")
            lost.update({r: v for r, v in verdicts.items() if v is not None})
            if lost:
                raise self._lose(lost, "before generation")
        for hook, kind in ((OOM_AT_GENERATION, "oom"), (HANG_AT_GENERATION, "hang")):
            for r, actor in enumerate(self._actors):
                if hook_hits(hook, self.generations, r):
                    self._get(actor.inject_fault.remote(kind), None, "take a test fault")

    def _after_generation_sent(self, refs: dict) -> None:
        for hook, sig in ((KILL_AT_GENERATION, signal.SIGKILL), (STOP_AT_GENERATION, signal.SIGSTOP)):
            for r in refs:
                if hook_hits(hook, self.generations, r):
                    os.kill(self._pids[r][0], sig)  # test hooks: the actors run on this machine

    # -- replacement (megarl.steps.EngineGeneration.recover) ---------------------------------------------------------
    def kill(self) -> None:
        """Kill the lost actors (their process trees where they run on this machine, then through Ray); nothing is
        asked of them."""
        import ray

        here = ray.util.get_node_ip_address()
        for r in sorted(self.lost):
            if self._pids[r] is not None and self._pids[r][1] == here:
                lifecycle.kill_tree(self._pids[r][0])
            try:
                ray.kill(self._actors[r], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._pids[r] = None
            self._joined.discard(r)

    def restart(self, version: int) -> None:
        """New actors in place of the lost ones (killed first), with the trainer's weight version `version`; their
        weights are the checkpoint's until the caller syncs the actor's into them."""
        self.kill()
        lost, t0 = sorted(self.lost), time.monotonic()
        for r in lost:
            self._actors[r] = self._new_actor(r)
        self._started(lost)
        self._get([self._actors[r].set_weight_version.remote(version) for r in lost], None, "take the weight version")
        self.restarted_hosts, self.lost = lost, {}
        log.info("Ray engine replica(s) %s restarted in %.1f s; they get the actor's weights next", lost,
                 time.monotonic() - t0)

    def set_weight_version(self, version: int) -> None:
        self._all("set_weight_version", version)

    # -- weights over the transfer group: one engine host per replica (megarl.sync.transports.remote) ------------------
    def transfer_layouts(self) -> list:
        return self._all("layouts")

    def start_join_transfer(self, spec, first_rank: int):
        refs = [a.join_transfer.remote(spec, first_rank + i) for i, a in enumerate(self._actors)]
        self._joined = set(range(len(self._actors)))
        return Deferred(lambda: self._get(refs, None, "join the weight transfer group"))

    def set_receive_plans(self, plans: list) -> None:
        self._get([a.set_receive_plan.remote(p) for a, p in zip(self._actors, plans)], None, "take the receive plan")

    def leave_transfer(self) -> None:
        """The actors in the transfer group leave it (a restarted actor never joined the old one)."""
        joined, self._joined = sorted(self._joined), set()
        self._get([self._actors[r].leave_transfer.remote() for r in joined], None, "leave the weight transfer group")

    def start_receive_weights(self, sync: int, verify: bool = False):
        refs = {r: a.receive_weights.remote(sync, verify) for r, a in enumerate(self._actors)}
        self.updates += 1
        for r in refs:
            if hook_hits(KILL_AT_UPDATE, self.updates, r):
                os.kill(self._pids[r][0], signal.SIGKILL)  # test hook: the actors run on this machine

        def wait() -> list:
            done, lost = self._watch(refs, "receive weights")
            if lost:
                self.lost.update(lost)
                raise RayReplicasLost("; ".join(f"replica {r}: {c}" for r, c in sorted(lost.items())), sorted(lost))
            return [done[r] for r in range(len(refs))]

        return Deferred(wait)

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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else type(exc).__name__
