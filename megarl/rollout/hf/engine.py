"""The transformers rollout engine (`rollout.name: hf`): the RolloutEngine interface on a HF causal LM, for machines
and models vLLM does not serve, and as an independent reference when an engine result looks wrong.

It runs where a vLLM engine runs (megarl.rollout.hosting.process starts it in the engine's child process) and takes the
same calls: `generate` (n samples per prompt, per-request seeds by VLLMEngine's rule, sampling logprobs computed as
vLLM's sampler does: megarl.rollout.hf.decode), `agenerate` (the multi-turn tool loop's turns, batched as they come),
`abort`, `sleep` / `wake_up` (the weights released or kept on the host; its KV cache lives only inside a generate
call), and the weight sync's UpdateTarget: one worker (TP1) whose layout reads every tensor whole, loading bucket
files or taking placed writes straight into its parameters (megarl.rollout.hf.weights), verified by checksums.

What vLLM does that it does not (engine TP/PP/EP, LoRA adapters in the engine, routed-expert capture, fp8, stop
strings) is refused by `megarl validate` (megarl.rollout.checks); vLLM's memory knobs (KV cache size, prefix caching,
chunked prefill, CUDA graphs) have no counterpart here and are reported as unused at start.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from megarl.config.schema import RolloutConfig
from megarl.rollout.hf.decode import Row, decode, sequence_logprobs
from megarl.rollout.hf.weights import (Arena, UnmappedTensor, copy_into_targets, drop_storages, parameter_bytes,
                                       restore_storages, tied_names, weight_targets)
from megarl.rollout.protocol import Deferred, EngineStartError
from megarl.rollout.requests import AbortSignal, Completion
from megarl.rollout.sampling import sampling_kwargs
from megarl.sync.boxes import box_numel, full_box, relative_slices
from megarl.sync.weights import Checksum, add_checksums, compare_checksums, tensor_checksum
from megarl.sync.wire import open_bucket, region

log = logging.getLogger(__name__)

# vLLM settings with no counterpart in this engine (its KV cache is transformers' own, per generate call)
VLLM_ONLY_KEYS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager", "cpu_prepack_weights",
                  "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching")
_KEPT_SLOTS = 8  # slot files kept mapped (as megarl.rollout.vllm.worker_ext)


class HFEngine:
    """A transformers causal LM driven by a RolloutConfig; arguments as VLLMEngine's (lora and cpu are refused /
    unused: megarl validate refuses the adapter sync with this engine)."""

    weight_version: int  # 0 = the weights loaded at start; +1 per update
    layouts: list  # the one worker's layout (megarl_layout's keys): every tensor read whole

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 device: Optional[str] = None, abort_signal: Optional[AbortSignal] = None,
                 lora: Optional[dict] = None, cpu: Any = None, where: str = "",
                 progress: Optional[Callable[[], None]] = None):
        from megarl.rollout.vllm.engine import PROMPT_OVERFLOW_CHOICES

        if prompt_overflow not in PROMPT_OVERFLOW_CHOICES:
            raise ValueError(f"prompt_overflow={prompt_overflow!r}: expected one of {PROMPT_OVERFLOW_CHOICES}")
        if lora:
            raise EngineStartError("rollout.name=hf with actor.lora.sync=adapter: the hf engine takes merged weights "
                                   "only. Fix: set actor.lora.sync=merged, or rollout.name=vllm",
                                   error_id="config-hf-engine")
        self.config, self.model_path, self.prompt_overflow = config, str(model_path), prompt_overflow
        self._feed = None  # megarl.sync.transports.feed, made by the first update_weights
        self.on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        self.dtype = config.resolved_dtype(self.on_gpu)
        self.weight_version = 0
        self.events: list[str] = []
        self.lora = None
        self.routes_shape = None
        self._signal = abort_signal or AbortSignal()
        self._progress = progress or (lambda: None)  # the watchdog's tick (megarl.rollout.health), once per step
        self._generator = torch.Generator(device="cuda" if self.on_gpu else "cpu").manual_seed(int(seed))
        self._pending: list = []  # agenerate rows waiting for the next batch
        self._pump: Optional[asyncio.Task] = None
        self._asleep: Optional[dict] = None
        self._arena: Optional[Arena] = None
        self._update: Optional[dict] = None
        self._slots: dict = {}
        t0 = time.perf_counter()
        self.model = self._load_model()
        self._shapes = self._checkpoint_shapes()
        self._retarget()
        self.start_seconds = time.perf_counter() - t0
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else self.model.config.eos_token_id
        self.eos_token_id = eos
        self.eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        self._tied = tied_names(self.model)
        self.layouts = [{"rank": 0, "modules": {}, "packed": {}, "tied": dict(self._tied),
                         "params": [n for n, _ in self.model.named_parameters()]}]
        unused = [k for k in VLLM_ONLY_KEYS if k in config.model_fields_set]
        if unused:
            log.info("rollout.name=hf: %s are vLLM settings this engine has no use for", ", ".join(unused))
        log.info("hf engine started in %.1fs (%s, %s, %d parameters)%s", self.start_seconds, type(self.model).__name__,
                 self.dtype, sum(p.numel() for p in self.model.parameters()), f"; {where}" if where else "")

    # -- start-up -----------------------------------------------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        dtype = getattr(torch, self.dtype)
        try:
            hf_config = AutoConfig.from_pretrained(self.model_path)
            # a vision-language model (Qwen2.5-VL, Qwen3-VL) with its vision tower: image prompts go through it
            auto = AutoModelForImageTextToText if hasattr(hf_config, "vision_config") else AutoModelForCausalLM
            if self.config.load_format == "dummy":  # random weights: the first sync brings the actor's
                model = auto.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
            else:
                model = auto.from_pretrained(self.model_path, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError, KeyError) as exc:
            raise EngineStartError(f"rollout.name=hf: transformers cannot load a causal LM from model.path="
                                   f"{self.model_path}: {exc}. Fix: point model.path at a HF model directory "
                                   "whose architecture transformers knows", error_id="engine-hf-load") from exc
        return model.to("cuda" if self.on_gpu else "cpu").eval().requires_grad_(False)

    def _checkpoint_shapes(self) -> dict:
        """{hf name: shape} the weight sync delivers: the bridge mapping's, or the model's own parameters where the
        bridge has no mapping for the architecture (the engine then generates, and only a state dict can update it)."""
        from megarl.bridge.hf_config import load_spec
        from megarl.bridge.mapping import Mapping

        try:
            return Mapping(load_spec(self.model_path)).hf_shapes()
        except Exception as exc:  # noqa: BLE001 - an architecture the bridge lacks is still served
            log.info("hf engine: no bridge mapping for %s (%s); updates take the model's own tensor names",
                     self.model_path, exc)
            return {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def _retarget(self) -> None:
        try:
            self._targets = weight_targets(self.model, self._shapes)
        except UnmappedTensor as exc:
            raise EngineStartError(f"rollout.name=hf: {exc}; the weight sync could not update it. Fix: "
                                   "rollout.name=vllm for this model", error_id="engine-hf-weights") from exc

    # -- generation ---------------------------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        return int(self.eos_ids[0]) if self.eos_ids else 0

    def _prompts(self, prompt_token_ids, prompt_index):
        from megarl.rollout.vllm.engine import apply_prompt_overflow

        ids = list(range(len(prompt_token_ids))) if prompt_index is None else [int(i) for i in prompt_index]
        if len(ids) != len(prompt_token_ids):
            raise ValueError(f"prompt_index has {len(ids)} entries for {len(prompt_token_ids)} prompts")
        return (ids, *apply_prompt_overflow(prompt_token_ids, self.config.prompt_length, self.prompt_overflow))

    def _decode(self, rows: Sequence[Row]) -> None:
        """Continue rows in batches of rollout.max_num_seqs; an abort raised after this call began ends them."""
        if self._asleep is not None and self._asleep.get("weights") is not None:
            raise RuntimeError("the hf engine is asleep (its weights are released): wake_up() before generating")
        epoch = self._signal.epoch

        def aborted() -> bool:  # asked before every decode step: the watchdog's tick too
            self._progress()
            return self._signal.epoch != epoch

        step = int(self.config.max_num_seqs)
        for i in range(0, len(rows), step):
            decode(self.model, rows[i:i + step], self.eos_ids, self.pad_id, self._generator,
                   self.config.logprobs_mode, aborted, self._stop_text if self.config.stop else None)

    def _stop_text(self, tokens: Sequence[int], stops: Sequence[str]) -> bool:
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        text = self._tokenizer.decode(list(tokens))
        return any(s in text for s in stops)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None, validate: bool = False,
                 prompt_index: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 greedy: bool = False, images: Optional[Sequence[Sequence]] = None):
        """As VLLMEngine.generate: prompt i's sample j uses seed + index_i * n + j when seed is given. images: each
        prompt's images (encoded bytes or paths; megarl.data.images) for a vision-language model, the prompt's ids
        holding each image's placeholder run (megarl.data.vision)."""
        t0 = time.perf_counter()
        ids, prompts, kept, cut = self._prompts(prompt_token_ids, prompt_index)
        if images is not None and any(cut):
            raise ValueError("an image prompt over rollout.prompt_length cannot be cut: its image tokens would no "
                             "longer match its images")
        pictures = [self._pixels(images[kept[k]], prompts[k]) if images is not None else None
                    for k in range(len(prompts))]
        kw = sampling_kwargs(self.config, validate=validate, n=n, greedy=greedy)
        n_eff = kw["n"]
        rows = [Row(list(p), kw, None if seed is None else int(seed) + ids[kept[k]] * n_eff + j, images=pictures[k])
                for k, p in enumerate(prompts) for j in range(n_eff)]
        self._decode(rows)
        groups = [ids[kept[k]] for k in range(len(prompts)) for _ in range(n_eff)]
        return self._batch(rows, groups, [cut[k] for k in range(len(prompts)) for _ in range(n_eff)], cut,
                           time.perf_counter() - t0, len(prompt_token_ids))

    def _pixels(self, refs: Sequence, prompt: Sequence[int]) -> Optional[tuple]:
        """(pixel_values, image_grid_thw) of one prompt's images (None without any), by the model's image processor;
        ValueError when the prompt's image tokens do not count its images' merged tokens."""
        if not refs:
            return None
        if getattr(self, "_images", None) is None:
            from transformers import AutoImageProcessor

            self._images = AutoImageProcessor.from_pretrained(self.model_path)
        from megarl.rollout.requests import open_rgb

        out = self._images(images=[open_rgb(r) for r in refs], return_tensors="pt")
        grid = out["image_grid_thw"].long()
        merge = int(self.model.config.vision_config.spatial_merge_size)
        want = int(grid.prod(-1).sum()) // merge ** 2
        have = sum(1 for t in prompt if t == self.model.config.image_token_id)
        if have != want:
            raise ValueError(f"a prompt holds {have} image tokens but its {len(refs)} image(s) make {want}")
        return out["pixel_values"], grid

    def continue_generate(self, prompt_token_ids, partial_ids, prompt_index, seeds):
        """As VLLMEngine.continue_generate: the new tokens only, prompt_ids as given."""
        t0 = time.perf_counter()
        kw = {**sampling_kwargs(self.config), "n": 1}
        rows = [Row(list(p) + list(r), {**kw, "max_tokens": self.config.response_length - len(r)}, int(s))
                for p, r, s in zip(prompt_token_ids, partial_ids, seeds)]
        self._decode(rows)
        for row, p in zip(rows, prompt_token_ids):
            row.prompt = list(p)
        return self._batch(rows, [int(i) for i in prompt_index], [False] * len(rows), [False] * len(rows),
                           time.perf_counter() - t0, len(rows))

    def _batch(self, rows: Sequence[Row], groups: list, pcut: list, cut: list, gen_s: float, num_prompts: int):
        from megarl.rollout.vllm.engine import VLLMEngine
        from megarl.types import pad_rows

        resp = pad_rows([r.tokens for r in rows], self.pad_id, torch.long)
        lps = pad_rows([r.logprobs for r in rows], 0.0, torch.float32, resp.shape[1]) \
            if self.config.calculate_log_probs else None
        lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)
        # the batch and its rollout/* metrics exactly as the vLLM engine builds them
        return VLLMEngine._rollout_batch(self, num_prompts, cut, [r.prompt for r in rows], resp, lengths, lps,
                                         [r.finish_reason for r in rows], groups, pcut, gen_s)

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> Deferred:
        return Deferred.ready(self.generate(prompt_token_ids, **kwargs))

    def start_continue(self, *args, **kwargs) -> Deferred:
        return Deferred.ready(self.continue_generate(*args, **kwargs))

    def sampling_kwargs(self, validate: bool = False, **overrides) -> dict[str, Any]:
        return {**sampling_kwargs(self.config, validate=validate), **overrides}

    async def agenerate(self, prompt_ids: Sequence[int], sampling: Mapping[str, Any], n: int = 1,
                        seed: Optional[int] = None) -> list[Completion]:
        """n continuations of one prompt (the j-th with seed + j); the calls in flight on this event loop are decoded
        together, one batch per round (a round starts once every ready coroutine has submitted)."""
        from megarl.rollout.vllm.engine import PromptTooLongError

        if len(prompt_ids) >= self.config.resolved_max_model_len:
            raise PromptTooLongError(f"agenerate: a prompt of {len(prompt_ids)} tokens exceeds the engine's "
                                     f"max_model_len {self.config.resolved_max_model_len}")
        rows = [Row(list(prompt_ids), dict(sampling), None if seed is None else int(seed) + j) for j in range(n)]
        done = asyncio.get_running_loop().create_future()
        self._pending.append((rows, done))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run_pending())
        await done
        version = self.weight_version
        want_lp = sampling.get("logprobs") is not None
        return [Completion(token_ids=r.tokens, logprobs=r.logprobs if want_lp else None,
                           finish_reason=r.finish_reason, token_versions=[version] * len(r.tokens), finished=True)
                for r in rows]

    async def _run_pending(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # every coroutine that is ready submits its turn first
            batch, self._pending = self._pending, []
            try:
                self._decode([r for rows, _ in batch for r in rows])
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                for _, done in batch:
                    done.set_exception(exc)
                continue
            for _, done in batch:
                done.set_result(None)

    def rollout_agents(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None,
                       validate: bool = False, prompt_index: Optional[Sequence[int]] = None,
                       seed: Optional[int] = None, extra_infos: Optional[Sequence[Optional[dict]]] = None):
        """Multi-turn rollouts with tools through the same driver as the vLLM engine (megarl.agent.loop)."""
        from megarl.rollout.vllm.engine import VLLMEngine

        return VLLMEngine.rollout_agents(self, prompt_token_ids, n=n, validate=validate, prompt_index=prompt_index,
                                         seed=seed, extra_infos=extra_infos)

    def _agent(self):
        from megarl.rollout.vllm.engine import VLLMEngine

        return VLLMEngine._agent(self)

    def _rollout_batch(self, *args, **kwargs):
        from megarl.rollout.vllm.engine import VLLMEngine

        return VLLMEngine._rollout_batch(self, *args, **kwargs)

    @property
    def set_weight_version(self, version: int) -> None:
        """As VLLMEngine.set_weight_version."""
        self.weight_version = int(version)

    def abort_epoch(self) -> int:
        return self._signal.epoch

    def abort(self) -> None:
        """End the rows being decoded (from any thread or, through the shared signal, the trainer's process): the
        running generate returns what each sample has, finish_reason 'abort'. Later calls run normally."""
        self._signal.raise_()

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Temperature-1 logprobs of each sequence's tokens after the first (megarl verify --engine hf)."""
        return sequence_logprobs(self.model, token_ids, self.pad_id)

    # -- weights (megarl.sync.seam.UpdateTarget) ------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False) -> dict:
        from megarl.sync.transports.feed import FullTensorFeed

        if self._feed is None:  # its slot files are kept from one feed to the next
            self._feed = FullTensorFeed(self.model_path)
        return self._feed.run(self, buckets, verify=verify)

    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        """Move the parameters into a shared-memory arena and report where each tensor of needs[0] lands (the probe
        records copy_into_targets' copies): the hosting trainer rank then writes every update straight into them."""
        from megarl.sync import placement

        mine = needs[0] if needs else None
        if not mine:
            return [{"why": "this worker needs no tensor"}]
        if self.on_gpu:
            return [{"why": "the hf engine's GPU parameters take bucket files"}]
        path = f"{prefix}-w0-arena"
        try:
            arena = placement.share_parameters(self.model.parameters(), path)
        except OSError as exc:
            return [{"why": str(exc), "failed": True}]
        self._retarget()  # the parameters' data moved: new views
        self._arena = Arena(path, arena.numel())
        self._arena_tensor = arena
        placed, refused = placement.probe_placements(lambda named: copy_into_targets(self._targets, named), [arena],
                                                     mine)
        return [{"arena": path, "size": arena.numel(), "placed": placed, "refused": refused}]

    def begin_update(self, verify: bool = False) -> None:
        self.events.append("update")
        self._update = {"sums": {} if verify else None, "tensors": set(), "bytes": 0}

    def _map(self, meta: dict) -> torch.Tensor:
        """A bucket file's mapping; slot files (meta["slot"]) stay mapped while their writer names the same file."""
        if "slot" not in meta:
            return open_bucket(meta["path"], int(meta["size"]))
        path, buf = self._slots.pop(meta["slot"], (None, None))
        if path != meta["path"] or buf.numel() < int(meta["size"]):
            buf = open_bucket(meta["path"], int(meta["size"]))
        self._slots[meta["slot"]] = (meta["path"], buf)
        while len(self._slots) > _KEPT_SLOTS:
            self._slots.pop(next(iter(self._slots)))
        return buf

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> int:
        """Copy this worker's boxes of one bucket file into the parameters (metas[0]; None: nothing)."""
        meta = metas[0] if metas else None
        if not meta:
            return 0
        buf, state = self._map(meta), self._update
        with torch.no_grad():
            for name, dtype, shape, offset, need, boxes in meta["tensors"]:
                full = region(buf, dtype, shape, int(offset))
                whole = full_box(tuple(shape))
                for box in boxes:
                    box = tuple(tuple(b) for b in box)
                    sl = relative_slices(box, whole)
                    self._targets[name][sl].copy_(full[sl])
                    state["bytes"] += box_numel(box) * full.element_size()
                    if state["sums"] is not None:
                        c = tensor_checksum(full[sl])
                        state["sums"][name] = add_checksums(state["sums"][name], c) if name in state["sums"] else c
                state["tensors"].add(name)
        return len(meta["tensors"])

    def end_update(self, placed: Optional[Sequence[Optional[dict]]] = None) -> dict:
        """Close the update (placed[0]: what the host wrote into the arena), bump the version; with verify, every
        tensor as the model holds it must equal what was received, or this raises naming them."""
        state, self._update = self._update or {"sums": None, "tensors": set(), "bytes": 0}, None
        mine = placed[0] if placed else None
        tensors, nbytes = len(state["tensors"]), state["bytes"]
        if mine:
            tensors += int(mine["tensors"])
            nbytes += int(mine["bytes"])
            if state["sums"] is not None:
                state["sums"].update(mine["sums"] or {})
        self.weight_version += 1
        metrics = {"weight_sync/version": float(self.weight_version), "weight_sync/num_tensors": float(tensors),
                   "weight_sync/engine_bytes": float(nbytes), "weight_sync/num_moe_reprocessed": 0.0,
                   "weight_sync/in_place": 1.0, "weight_sync/num_tied_reloaded": 0.0}
        if state["sums"] is not None:
            report = compare_checksums(state["sums"], self.checksums())
            metrics["weight_sync/verified_tensors"] = float(report["checked"])
            if not report["ok"]:
                raise RuntimeError(f"weight sync verification failed at version {self.weight_version} on the hf "
                                   f"engine: mismatched {report['mismatched'][:8]}, not in the engine "
                                   f"{report['missing_in_engine'][:8]}")
        return metrics

    def abort_update(self) -> None:
        """End a failed update: the version stays; tensors written before the failure keep their new values."""
        self._update = None

    def checksums(self) -> dict[str, Checksum]:
        """Checksum of every checkpoint tensor as the model holds it (HF names; a tied head under its own name)."""
        out = {name: tensor_checksum(view) for name, view in self._targets.items()}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for alias, canonical in self._tied.items():
            if alias not in out and canonical in out:
                out[alias] = tensor_checksum(params[alias])
        return out

    def expected_checksums(self, hf_checksums: Mapping[str, Checksum]) -> dict[str, Checksum]:
        """The engine holds HF names: the same checksums, a tied alias expected to equal its canonical tensor."""
        out = dict(hf_checksums)
        for alias, canonical in self._tied.items():
            if alias not in out and canonical in out:
                out[alias] = out[canonical]
        return out

    def verify_weights(self, expected: Mapping[str, Checksum], rtol: float = 1e-9) -> dict:
        return compare_checksums(expected, self.checksums(), rtol=rtol)

    # -- memory -------------------------------------------------------------------------------------------------------
    @property
    def sleeps(self) -> bool:
        """rollout.enable_sleep_mode with free_cache_engine, as the vLLM engine."""
        return bool(self.config.enable_sleep_mode and self.config.free_cache_engine)

    def parameter_bytes(self) -> int:
        """Bytes the weights hold now (the arena's resident pages once the sync writes in place)."""
        return self._arena.resident_bytes() if self._arena is not None else parameter_bytes(self.model)

    def sleep(self, level: int = 2) -> None:
        """Release the weights: level 2 drops them (the next sync refills them), level 1 keeps a host copy that
        wake_up restores (on CPU that copy is the same kind of memory: level 1 only matters on a GPU). The KV cache
        exists only inside a generate call. Only with rollout.enable_sleep_mode (as vLLM); always recorded."""
        self.events.append("sleep" if level == 2 else f"sleep({level})")
        if not self.sleeps or self._asleep is not None:
            return
        if self._arena is not None:
            backup = self._arena_tensor.clone() if level == 1 else None
            self._arena.release()
            self._asleep = {"weights": ("arena", backup)}
        else:
            self._asleep = {"weights": ("storages", drop_storages(self.model, keep_on_host=level == 1))}

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take the weights' memory back (tags None or with "weights"); "kv_cache" has nothing to retake."""
        self.events.append("wake_up" + (f"({','.join(tags)})" if tags else ""))
        if self._asleep is None or (tags is not None and "weights" not in tags):
            return
        kind, saved = self._asleep.pop("weights")
        if kind == "arena":
            if saved is not None:
                self._arena_tensor.copy_(saved)
        else:
            restore_storages(saved)
        self._asleep = None

    def shutdown(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._slots.clear()
