"""The agent loop: many multi-turn trajectories in flight at once on one asyncio loop, next to the engine.

One trajectory:
    model turn (await agenerate, max_tokens = what is left of rollout.response_length)
      -> parse tool calls (rollout.multi_turn.format)        none: the model answered, the trajectory ends
      -> run up to max_parallel_calls of them concurrently   errors become the tool's response text
      -> append the template's tool turn as token ids        loss mask 0, logprob 0
      -> next model turn                                     loss mask 1, the engine's logprobs
It also ends at max_assistant_turns / max_user_turns (tool/truncated_by_max_turns) and when the budget runs out (a
tool turn that would leave no room for a model token is not appended; finish_reason "length").

`agenerate(prompt_ids, sampling, n=1, seed=None) -> list[Completion]` is the engine's async interface
(VLLMEngine.agenerate); a Completion (megarl.rollout.requests) has token_ids, logprobs (or None), finish_reason
("stop" | "length" | "abort").
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

import torch

from megarl.agent.parse import parse_tool_calls
from megarl.agent.render import ChatRenderer
from megarl.agent.tools import ERROR_KINDS, ToolCall, ToolResult, ToolSet, TrajectoryState, truncate_text
from megarl.types import pad_rows

AGenerate = Callable[..., Awaitable[list]]
# per-rollout counts (they add up over engine replicas); rates are derived from them by tool_rates
COUNT_KEYS = ("tool/samples", "tool/calls", "tool/assistant_turns", "tool/tool_turns", "tool/samples_with_calls",
              "tool/samples_with_ok_calls", "tool/truncated_by_max_turns", "tool/truncated_by_budget",
              "tool/truncated_responses", "tool/reward_sum", "tool/sanity_checked", "tool/sanity_drift",
              *(f"tool/errors/{k}" for k in ERROR_KINDS))
TURN_SEED_STRIDE = 1_000_003  # turn t of a sample samples with seed + t * stride


@dataclass
class Trajectory:
    """One sample's response after the prompt: ids, the engine's logprobs (0 on tool tokens), loss mask."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    assistant_turns: int = 0
    tool_turns: int = 0
    calls: int = 0
    ok_calls: int = 0
    tool_reward: float = 0.0
    errors: dict = field(default_factory=dict)
    truncated_by_max_turns: bool = False
    truncated_by_budget: bool = False
    truncated_responses: int = 0
    drift: Optional[bool] = None  # sanity check: None when not checked
    turns: list = field(default_factory=list)  # ("assistant", ids) / ("tool", texts, ids), for the sanity check

    def add(self, ids: Sequence[int], logprobs: Optional[Sequence[float]], model: bool) -> None:
        self.response_ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)
        self.mask += [int(model)] * len(ids)


class AgentRollout:
    """Runs trajectories for a rollout config (its multi_turn section), a tokenizer and a tool set."""

    def __init__(self, rollout_cfg, tokenizer: Any, tools: ToolSet):
        self.cfg = rollout_cfg
        self.mt = rollout_cfg.multi_turn
        self.tok = tokenizer
        self.tools = tools
        self.renderer = ChatRenderer(tokenizer, rollout_cfg.stop_token_ids)

    async def _run_calls(self, calls: list[ToolCall], state: TrajectoryState, traj: Trajectory) -> list[str]:
        limit = self.mt.max_parallel_calls
        results: list[ToolResult] = list(await asyncio.gather(*(self.tools.execute(c, state) for c in calls[:limit])))
        results += [ToolResult(f"Error: only {limit} tool call(s) per turn are executed", error="too_many_calls")
                    for _ in calls[limit:]]
        texts = []
        for r in results:
            traj.calls += 1
            if r.error:
                traj.errors[r.error] = traj.errors.get(r.error, 0) + 1
            else:
                traj.ok_calls += 1
            traj.tool_reward += r.reward
            text, cut = truncate_text(r.text, self.mt.max_tool_response_length, self.mt.tool_response_truncate_side)
            traj.truncated_responses += cut
            texts.append(text)
        return texts

    def _turn_limit_reached(self, traj: Trajectory) -> bool:
        mt = self.mt
        return ((mt.max_assistant_turns is not None and traj.assistant_turns >= mt.max_assistant_turns)
                or (mt.max_user_turns is not None and traj.tool_turns >= mt.max_user_turns))

    async def trajectory(self, agenerate: AGenerate, prompt_ids: Sequence[int], sampling: dict,
                         seed: Optional[int], state: TrajectoryState) -> Trajectory:
        budget = int(self.cfg.response_length)
        traj = Trajectory()
        try:
            while True:
                left = budget - len(traj.response_ids)
                turn_seed = None if seed is None else seed + traj.assistant_turns * TURN_SEED_STRIDE
                out = (await agenerate(list(prompt_ids) + traj.response_ids, {**sampling, "max_tokens": left},
                                       n=1, seed=turn_seed))[0]
                traj.add(out.token_ids, out.logprobs, model=True)
                traj.assistant_turns += 1
                traj.turns.append(("assistant", list(out.token_ids)))
                traj.finish_reason = out.finish_reason
                if out.finish_reason != "stop":
                    break
                calls = parse_tool_calls(self.renderer.turn_content(out.token_ids), self.mt.format)
                if not calls:
                    break
                if self._turn_limit_reached(traj):
                    traj.truncated_by_max_turns = True
                    break
                texts = await self._run_calls(calls, state, traj)
                ids = self.renderer.tool_turn(out.token_ids, texts)
                if len(traj.response_ids) + len(ids) >= budget:  # no room left for the model to answer
                    traj.truncated_by_budget = True
                    traj.finish_reason = "length"
                    break
                traj.add(ids, None, model=False)
                traj.tool_turns += 1
                traj.turns.append(("tool", texts, ids))
        finally:
            await self.tools.release(state)
        if self.mt.sanity_check and traj.finish_reason == "stop" and traj.turns[-1][0] == "assistant":
            traj.drift = self._drifts(traj)
        return traj

    def _drifts(self, traj: Trajectory) -> bool:
        """Whether a fresh rendering of the conversation (after the prompt) differs from the trajectory's ids. The
        model's turns enter both sides as the tokenizer's encoding of their text: a model may sample another split
        of the same text, which is its own choice and trained as sampled; what is checked is everything the loop
        added (the template's text around the turns, the tool turns, their tokenization)."""
        r = self.renderer
        ids = []
        for turn in traj.turns:
            if turn[0] == "assistant":
                stop = [turn[1][-1]] if turn[1] and int(turn[1][-1]) in r.stop_ids else []
                ids += r.encode(r.turn_content(turn[1])) + stop
            else:
                ids += turn[2]
        return r.render_response(traj.turns) != ids + r.encode(r.suffix_after(traj.turns[-1][1]))

    async def run(self, agenerate: AGenerate, prompts: Sequence[Sequence[int]], n: int, sampling: dict,
                  seeds: Sequence[Optional[int]], extra_infos: Optional[Sequence[Optional[dict]]] = None
                  ) -> list[Trajectory]:
        """n trajectories per prompt, all in flight at once; returned prompt-major. seeds: one per sample."""
        jobs = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                state = TrajectoryState(f"{p}-{j}", extra_infos[p] if extra_infos else None)
                jobs.append(self.trajectory(agenerate, prompt, sampling, seeds[p * n + j], state))
        return list(await asyncio.gather(*jobs))


def trajectory_counts(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The COUNT_KEYS metrics of a rollout's trajectories."""
    m = {k: 0.0 for k in COUNT_KEYS}
    for t in trajs:
        m["tool/samples"] += 1
        m["tool/calls"] += t.calls
        m["tool/assistant_turns"] += t.assistant_turns
        m["tool/tool_turns"] += t.tool_turns
        m["tool/samples_with_calls"] += t.calls > 0
        m["tool/samples_with_ok_calls"] += t.ok_calls > 0
        m["tool/truncated_by_max_turns"] += t.truncated_by_max_turns
        m["tool/truncated_by_budget"] += t.truncated_by_budget
        m["tool/truncated_responses"] += t.truncated_responses
        m["tool/reward_sum"] += t.tool_reward
        m["tool/sanity_checked"] += t.drift is not None
        m["tool/sanity_drift"] += bool(t.drift)
        for kind, count in t.errors.items():
            m[f"tool/errors/{kind}"] += count
    return m


def tool_rates(m: dict) -> dict[str, float]:
    """Means and rates derived from the counts (recomputed after replicas' counts are summed)."""
    samples = max(1.0, m.get("tool/samples", 0.0))
    calls = m.get("tool/calls", 0.0)
    errors = sum(m.get(f"tool/errors/{k}", 0.0) for k in ERROR_KINDS)
    return {"tool/turns_mean": m.get("tool/assistant_turns", 0.0) / samples,
            "tool/calls_per_sample": calls / samples,
            "tool/use_rate": m.get("tool/samples_with_calls", 0.0) / samples,
            "tool/ok_use_rate": m.get("tool/samples_with_ok_calls", 0.0) / samples,
            "tool/error_rate": errors / calls if calls else 0.0}


def trajectory_tensors(trajs: Sequence[Trajectory], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded [N, R] response_ids, rollout_logprobs, loss_mask; [N] lengths and tool rewards."""
    ids = pad_rows([t.response_ids for t in trajs], pad, torch.long)
    width = ids.shape[1]
    return {"response_ids": ids, "rollout_logprobs": pad_rows([t.logprobs for t in trajs], 0.0, torch.float32, width),
            "loss_mask": pad_rows([t.mask for t in trajs], False, torch.bool, width),
            "response_lengths": torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.long),
            "tool_rewards": torch.tensor([t.tool_reward for t in trajs], dtype=torch.float32)}
