"""Resumable training state: save and resume everything a run needs to continue as if it had never stopped.

On disk (`<run_dir>/checkpoints/`):

    step_<N>/
      actor/                 megatron dist_checkpointing directory (torch_dist): model + optimizer shards, and in its
                             common state the LR scheduler and the update counter
      critic/                the same for the critic (PPO with GAE)
      rng/rank_<r>.pt        each rank's RNG states (python, numpy, torch CPU/CUDA, megatron model-parallel tracker)
      trainer_state.json     step, data position (PromptLoader), KL controller, ...
      config.resolved.yaml   the config the run used
      meta.json              written last: step, megarl version, layout version, world size, parallelism, complete
    step_<N>.tmp/            a save in progress (or one a crash interrupted): ignored, removed by the next save

A save writes into `step_<N>.tmp`, every rank takes part, a barrier waits for all, then rank 0 writes meta.json and
renames the directory to `step_<N>`. A crash at any point (SIGKILL included) leaves the earlier checkpoints intact and
at most a `.tmp` directory that discovery ignores. Only directories named `step_<N>` whose meta.json says
`"complete": true` count as checkpoints.

Models and optimizer states are saved as megatron sharded state dicts, so a checkpoint saved at one TP/PP layout
loads at another (dist_checkpointing reshards both). RNG states are per rank: they are restored when the world size
and layout are unchanged, otherwise the fresh seeding of the new layout stands (logged).

Rollout sampling does not need the engine's RNG state: the trainer passes a per-step seed (`rollout_seed`), so a
resumed run samples exactly what an uninterrupted one would.

Test hooks (environment variables, read at save time; never set them in real runs):
  MEGARL_TEST_SIGKILL_IN_SAVE=<N>   every rank SIGKILLs itself in the middle of saving step N (after the model files)
  MEGARL_TEST_SIGTERM_AT_STEP=<N>   rank 0 sends itself SIGTERM at the end of step N (as a scheduler would)
  MEGARL_TEST_RAISE_AT_STEP=<N>:<R> rank R raises RuntimeError at the end of step N (a fault on one rank)
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from megarl.checkpoint.locate import (LAYOUT_VERSION, META_FILE, TRAINER_STATE_FILE, checkpoints_dir, checkpoints_to_delete,
                                     complete_checkpoints, read_meta, resolve_resume, stale_entries, step_dir)
from megarl.lifecycle import SignalWatcher, die_with_parent

log = logging.getLogger("megarl")


def rollout_seed(cfg, step: int) -> int:
    """The sampling seed of one RL step (from rollout.seed, else trainer.seed): a resumed run samples exactly what an
    uninterrupted run would. The engine gives prompt i of the batch seed + i*n, so steps are spaced far apart."""
    base = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed
    return (int(base) * 1_000_003 + int(step) * 7_919_113) % (2 ** 31)


# ---------------------------------------------------------------------------------------------------------------------
# RNG states (per rank)
# ---------------------------------------------------------------------------------------------------------------------


def rng_state() -> dict:
    import numpy as np
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------------------------------------------------------------
# Models and optimizers through megatron dist_checkpointing
# ---------------------------------------------------------------------------------------------------------------------

# Fully reshardable optimizer formats (the distributed optimizer on GPU uses this; the plain one ignores it).
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space", "chained_optim_avoid_prefix": True}


def _trainable(model):
    """A megarl Trainable, from itself or a worker holding one (`.trainable`)."""
    return getattr(model, "trainable", model)


def _model_sharded_state_dict(chunks) -> dict:
    """Megatron's convention: `model` for one chunk, `model0`, `model1`, ... for virtual pipeline chunks."""
    modules = [getattr(c, "module", c) for c in chunks]  # unwrap megatron DDP
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}


def sharded_state_dict(trainable, with_optimizer: bool, is_loading: bool) -> dict:
    """What dist_checkpointing saves/loads for one trainable model: model chunks, optimizer, scheduler, counter."""
    state = _model_sharded_state_dict(trainable.chunks)
    if with_optimizer:
        state["optimizer"] = trainable.optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                                    metadata=dict(_OPTIM_METADATA))
    state["scheduler"] = trainable.scheduler.state_dict()
    state["steps"] = int(trainable.steps)
    return state


_WRITER_MANAGERS: list = []


def _writer_queue_dies_with_rank() -> None:
    """dist_checkpointing's file writer (megatron-core 0.16.1, filesystem_async._results_queue) collects results through
    a queue served by a spawned multiprocessing Manager. When the rank is SIGKILLed (a scheduler's hard kill) that
    server process, and the resource tracker it holds open, would outlive it. Start the Manager ourselves, once per
    process, with a parent-death signal; megatron then reuses its queue."""
    import multiprocessing
    import sys
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not sys.platform.startswith("linux") or getattr(filesystem_async, "_results_queue", True) is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    _WRITER_MANAGERS.append(manager)  # keep it (and its queue) alive for the process's lifetime
    filesystem_async._results_queue = manager.Queue()


def save_trainable(trainable, directory: Path) -> None:
    """Collective: every rank writes its shards of the model and optimizer into `directory` (it must exist)."""
    from megatron.core import dist_checkpointing

    _writer_queue_dies_with_rank()
    dist_checkpointing.save(sharded_state_dict(trainable, with_optimizer=True, is_loading=False), str(directory))


def load_trainable(trainable, directory: Path, load_optimizer: bool = True) -> None:
    """Collective: load this rank's shards (any layout) into the model chunks, the optimizer and the scheduler."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(sharded_state_dict(trainable, with_optimizer=load_optimizer, is_loading=True),
                                    str(directory))
    chunks = trainable.chunks
    for i, chunk in enumerate(chunks):
        module = getattr(chunk, "module", chunk)
        missing, unexpected = module.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"],
                                                     strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {directory} does not match the model: missing {missing[:8]}, "
                               f"unexpected {unexpected[:8]}; resume with the same model architecture")
    if load_optimizer:
        trainable.optimizer.load_state_dict(state["optimizer"])
    else:
        trainable.optimizer.reload_model_params()  # mixed precision: main params from the loaded model weights
    # The schedule comes from this run's config (it may train longer); only the position comes from the checkpoint.
    trainable.scheduler.override_opt_param_scheduler = True
    trainable.scheduler.load_state_dict(state["scheduler"])
    trainable.steps = int(state["steps"])


# ---------------------------------------------------------------------------------------------------------------------
# Stop requests (SIGTERM)
# ---------------------------------------------------------------------------------------------------------------------


class StopRequest:
    """SIGTERM and SIGINT during a run. With save_on_sigterm the first one only sets a flag, and `agreed()`
    all-reduces it so every rank saves and stops after the same step; without it, or on a second signal, the process
    ends at once (see megarl.lifecycle.SignalWatcher: this works also while a rank is blocked in a collective)."""

    def __init__(self, enabled: bool):
        self.requested = threading.Event()  # set by the watcher thread when it acts on the first signal
        self._watcher = None
        try:
            self._watcher = SignalWatcher(on_first=self._handle if enabled else None)
        except ValueError:  # not the main thread (an embedding application): it keeps its own handling
            log.warning("not in the main thread: SIGTERM/SIGINT keep the application's handling")

    def _handle(self, signum: int) -> None:
        self.requested.set()
        log.warning("%s received: saving a checkpoint at the end of this step, then stopping (send it again to stop "
                    "now, without saving)", signal.Signals(signum).name)

    def agreed(self) -> bool:
        """Collective: True on every rank when any rank received a stop signal."""
        import torch.distributed as dist

        from megarl.distributed import all_reduce, compute_device

        flag = torch.tensor([1.0 if self.requested.is_set() else 0.0], device=compute_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None


# ---------------------------------------------------------------------------------------------------------------------
# The run's checkpointer
# ---------------------------------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _test_hook(name: str, step: int, rank: Optional[int] = None) -> bool:
    """The hook `name` is set for `step` (value "N", or "N:R" to also match rank R)."""
    value = os.environ.get(name)
    if value is None:
        return False
    at_step, _, at_rank = value.strip().partition(":")
    return at_step == str(step) and (rank is None or at_rank == str(rank))


class Checkpointer:
    """Saves and resumes a run: trainable models (actor, critic) and any objects with state_dict/load_state_dict.

        ckpt = Checkpointer(cfg, rt, models={"actor": actor, "critic": critic}, states={"loader": loader, ...})
        start_step = ckpt.resume()            # 0 for a fresh run
        for step in range(start_step + 1, total + 1):
            ...
            if ckpt.after_step(step):         # saves when due; True when the run must stop (SIGTERM)
                break
    Every method is collective (call on every rank).
    """

    def __init__(self, cfg, rt, models: Mapping[str, Any], states: Mapping[str, Any]):
        self.cfg = cfg
        self.rt = rt
        self.models = {k: _trainable(m) for k, m in models.items() if m is not None}
        self.states = {k: s for k, s in states.items() if s is not None}
        self.before_save: list = []  # callables run before a save (the trainer brings offloaded states back)
        self.root = checkpoints_dir(cfg.trainer.run_dir)
        self.stop = StopRequest(cfg.checkpoint.save_on_sigterm)
        self.last_saved: Optional[int] = None

    # -- layout ------------------------------------------------------------------------------------------------------
    def _parallelism(self) -> dict:
        p = self.cfg.parallelism
        return {"tensor_model_parallel_size": p.tensor_model_parallel_size,
                "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
                "context_parallel_size": p.context_parallel_size,
                "expert_model_parallel_size": p.expert_model_parallel_size,
                "expert_tensor_parallel_size": p.expert_tensor_parallel_size,
                # uneven stages change which rank holds which layer (a resume under other stages reshards)
                "num_layers_in_first_pipeline_stage": p.num_layers_in_first_pipeline_stage,
                "num_layers_in_last_pipeline_stage": p.num_layers_in_last_pipeline_stage}

    # -- save --------------------------------------------------------------------------------------------------------
    def should_save(self, step: int, stopping: bool = False) -> bool:
        freq = self.cfg.checkpoint.save_freq
        return stopping or step == self.cfg.trainer.total_steps or bool(freq and step % freq == 0)

    def after_step(self, step: int) -> bool:
        """Collective, once per step: save when due (save_freq, the last step, a SIGTERM). True: stop the run now."""
        if self.rt.is_rank0 and _test_hook("MEGARL_TEST_SIGTERM_AT_STEP", step):
            os.kill(os.getpid(), signal.SIGTERM)
            # a scheduler's signal comes during the step; this one comes just before the check below, and the watcher
            # thread acts on it asynchronously: wait for it, or the stop lands a step late wherever that thread is slow
            self.stop.requested.wait(10)
        if _test_hook("MEGARL_TEST_RAISE_AT_STEP", step, self.rt.rank):
            raise RuntimeError(f"MEGARL_TEST_RAISE_AT_STEP: injected fault at step {step} on rank {self.rt.rank}")
        stopping = self.stop.agreed()
        if self.should_save(step, stopping) and self.last_saved != step:
            self.save(step)
        return stopping

    def save(self, step: int) -> Path:
        """Collective: write step_<step> atomically; then keep only the newest checkpoint.keep_last_k."""
        import torch.distributed as dist

        from megarl import __version__
        from megarl.config import write_resolved

        t0 = time.perf_counter()
        for hook in self.before_save:
            hook()
        for s in self.states.values():  # e.g. the rollout schedule awaits its generations in flight (collective)
            if hasattr(s, "before_save"):
                s.before_save()
        final, tmp = step_dir(self.root, step), Path(str(step_dir(self.root, step)) + ".tmp")
        if self.rt.is_rank0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in stale_entries(self.root):  # what an earlier crash left behind
                log.warning("removing incomplete checkpoint %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
            for name in self.models:
                (tmp / name).mkdir()
        dist.barrier()
        for name, trainable in self.models.items():
            save_trainable(trainable, tmp / name)
        if _test_hook("MEGARL_TEST_SIGKILL_IN_SAVE", step):
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save(rng_state(), tmp / "rng" / f"rank_{self.rt.rank:05d}.pt")
        if self.rt.is_rank0:
            _write_json(tmp / TRAINER_STATE_FILE,
                        {"step": step, **{name: s.state_dict() for name, s in self.states.items()}})
            write_resolved(self.cfg, tmp)
        dist.barrier()  # every rank's files are written
        if self.rt.is_rank0:
            _write_json(tmp / META_FILE, {
                "step": step, "megarl_version": __version__, "layout": LAYOUT_VERSION,
                "world_size": self.rt.world_size, "parallelism": self._parallelism(), "models": sorted(self.models),
                "optimizer": True, "states": sorted(self.states), "saved_at": time.time(), "complete": True})
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step (a resume from an older checkpoint): swap, then delete the old one
                old = Path(str(final) + ".old.tmp")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync_dir(self.root)
            for path in checkpoints_to_delete(self.root, self.cfg.checkpoint.keep_last_k):
                shutil.rmtree(path, ignore_errors=True)
            log.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - t0)
        dist.barrier()
        self.last_saved = step
        return final

    # -- resume ------------------------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Collective: load checkpoint.resume (auto / a path / disable). Returns the step resumed from (0: fresh)."""
        from megarl.distributed import broadcast_object

        found = None
        if self.rt.is_rank0:  # one rank looks, so every rank resumes from the same checkpoint
            try:
                path = resolve_resume(self.cfg.checkpoint.resume, self.cfg.trainer.run_dir)
                found = ("ok", str(path) if path else None)
            except ValueError as exc:
                found = ("error", str(exc))
        kind, value = broadcast_object(found)
        if kind == "error":
            raise ValueError(value)  # on every rank, so none waits for the others
        return self.load(Path(value)) if value else 0

    def load(self, path: Path) -> int:
        """Collective: load the models, optimizers, schedulers, states and (same layout only) RNG from `path`."""
        meta = read_meta(path)
        if not meta or not meta.get("complete"):
            raise ValueError(f"{path} is not a complete megarl checkpoint (no meta.json with complete=true)")
        if meta.get("layout") != LAYOUT_VERSION:
            raise ValueError(f"{path} has checkpoint layout {meta.get('layout')!r}; this megarl reads "
                             f"{LAYOUT_VERSION!r}")
        missing = [name for name in self.models if name not in meta["models"]]
        if missing:
            raise ValueError(f"checkpoint {path} has no {missing} (it holds {meta['models']}); resume a run with the "
                             f"same models (e.g. the critic of PPO with GAE), or set checkpoint.resume=disable")
        t0 = time.perf_counter()
        for name, trainable in self.models.items():
            load_trainable(trainable, path / name, load_optimizer=self.cfg.checkpoint.load_optimizer)
        state = json.loads((path / TRAINER_STATE_FILE).read_text())
        for name, obj in self.states.items():
            if name in state:
                obj.load_state_dict(state[name])
            else:
                log.warning("checkpoint %s has no %r state; it starts fresh", path, name)
        rng_file = path / "rng" / f"rank_{self.rt.rank:05d}.pt"
        now = self._parallelism()
        if meta["world_size"] == self.rt.world_size and {k: meta["parallelism"].get(k) for k in now} == now \
                and rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        elif self.rt.is_rank0:
            log.warning("checkpoint %s was saved with %d ranks and parallelism %s: RNG states are per rank, so they "
                        "are not restored at this layout (models and optimizers are resharded)", path,
                        meta["world_size"], meta["parallelism"])
        step = int(state["step"])
        later = [p for s, p in complete_checkpoints(self.root) if s > step]
        if later and self.rt.is_rank0:
            log.warning("resuming from step %d while later checkpoints exist (%s); they are replaced as the run "
                        "reaches their steps", step, ", ".join(p.name for p in later))
        log.info("resumed from %s (step %d) in %.1f s", path, step, time.perf_counter() - t0)
        if step >= self.cfg.trainer.total_steps and self.rt.is_rank0:
            log.warning("the checkpoint is at step %d and trainer.total_steps=%d: nothing left to train (raise "
                        "trainer.total_steps to continue, or set checkpoint.resume=disable to start over)", step,
                        self.cfg.trainer.total_steps)
        self.last_saved = step
        return step

    def close(self) -> None:
        self.stop.close()
