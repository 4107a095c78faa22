"""The typed records passed between the stages of an RL step. Shapes are documented on every field.

Notation: P prompts go into a rollout; each is sampled n times, giving N = P * n samples, ordered prompt-major
(all samples of prompt 0, then all of prompt 1, ...). R is the longest response in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

FINISH_REASONS = ("stop", "length", "abort")


def pad_rows(rows, fill, dtype: torch.dtype, width: Optional[int] = None) -> torch.Tensor:
    """Ragged rows (N sequences of numbers) -> a right-padded tensor [N, width] (default: the longest row)."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


@dataclass
class RolloutBatch:
    """Responses sampled by a rollout engine, one row per sample.

    Ragged data (prompts) stays as Python lists; everything with a response axis is a right-padded tensor, so a
    trainer can slice, mask and broadcast it directly. Use `response_mask()` for the valid positions.

    Fields:
        prompt_ids: list of N lists of int. The prompt of each sample, as the engine saw it (after any truncation).
        response_ids: LongTensor [N, R]. Sampled tokens, right-padded with `pad_token_id`.
        response_lengths: LongTensor [N]. Valid tokens per row of `response_ids` (0 <= length <= R).
        rollout_logprobs: FloatTensor [N, R] or None. Log-probability under the engine of each sampled token,
            0.0 on padding; None when logprobs were not requested (rollout.calculate_log_probs=False).
        finish_reasons: list of N str, each in FINISH_REASONS: "stop" (EOS or a stop token/string), "length"
            (hit rollout.response_length or max_model_len), "abort" (the request was aborted).
        truncated: BoolTensor [N]. True where the response was cut by the length limit (finish_reason == "length").
        prompt_index: LongTensor [N]. Group id: the index of each sample's prompt in the caller's prompt list (or the
            caller's own ids when it passed `prompt_index`). Samples with the same id form one GRPO group.
        prompt_truncated: BoolTensor [N]. True where the prompt was longer than rollout.prompt_length and was cut.
        weight_version: the engine weight version that produced every sample (0 = the weights loaded at start).
        pad_token_id: the value used to pad `response_ids`.
        loss_mask: BoolTensor [N, R] or None. Multi-turn rollouts: True on the tokens the model sampled (they carry
            rollout logprobs and are trained on), False on tool responses and chat-template tokens between turns (their
            logprob is 0.0) and on padding. None: every valid response token is the model's (single-turn).
        tool_rewards: FloatTensor [N] or None. Multi-turn rollouts: the sum of the rewards the sample's tool calls
            returned, added to its reward. None: no tools.
        metrics: scalar metrics of the rollout (counts, seconds, tokens/s), names prefixed "rollout/".
        routed_experts: ShortTensor [N, W, L, k] or None (rollout.return_routed_experts). The experts the engine
            routed each token of prompt + response to, per decoder layer (0-based; top-k expert ids), by sequence
            position: W >= every row's prompt + response length; -1 where the engine forwarded no such token (the
            last one of each row, padding) and in layers without a router.
        token_versions: LongTensor [N, R] or None. The weight version (trainer steps, see megarl.rollout.schedule)
            that sampled each token, 0 on padding; set by the rollout schedule (a response resumed after a weight
            sync mixes versions). None: every token is `weight_version`'s.
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_lengths: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor]
    finish_reasons: list[str]
    truncated: torch.Tensor
    prompt_index: torch.Tensor
    prompt_truncated: torch.Tensor
    weight_version: int = 0
    pad_token_id: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    token_versions: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    tool_rewards: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        checks = {
            "response_ids": (self.response_ids, 2, torch.long),
            "response_lengths": (self.response_lengths, 1, torch.long),
            "truncated": (self.truncated, 1, torch.bool),
            "prompt_index": (self.prompt_index, 1, torch.long),
            "prompt_truncated": (self.prompt_truncated, 1, torch.bool),
        }
        if self.rollout_logprobs is not None:
            checks["rollout_logprobs"] = (self.rollout_logprobs, 2, torch.float32)
        if self.token_versions is not None:
            checks["token_versions"] = (self.token_versions, 2, torch.long)
        if self.loss_mask is not None:
            checks["loss_mask"] = (self.loss_mask, 2, torch.bool)
        if self.tool_rewards is not None:
            checks["tool_rewards"] = (self.tool_rewards, 1, torch.float32)
        for name, (t, ndim, dtype) in checks.items():
            if t.ndim != ndim or t.shape[0] != n or t.dtype != dtype:
                raise ValueError(f"RolloutBatch.{name}: expected a {dtype} tensor with {ndim} dims and {n} rows, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        for name in ("rollout_logprobs", "token_versions", "loss_mask"):
            t = getattr(self, name)
            if t is not None and t.shape != self.response_ids.shape:
                raise ValueError(f"RolloutBatch.{name} {tuple(t.shape)} must have the shape of response_ids "
                                 f"{tuple(self.response_ids.shape)}")
        r = self.routed_experts
        if r is not None and (r.ndim != 4 or r.shape[0] != n or r.dtype != torch.int16):
            raise ValueError(f"RolloutBatch.routed_experts: expected an int16 tensor [N, W, layers, top_k] with {n} "
                             f"rows, got {r.dtype} {tuple(r.shape)}")
        if len(self.finish_reasons) != n:
            raise ValueError(f"RolloutBatch.finish_reasons has {len(self.finish_reasons)} entries for {n} samples")
        bad = sorted({r for r in self.finish_reasons if r not in FINISH_REASONS})
        if bad:
            raise ValueError(f"RolloutBatch.finish_reasons: unknown reasons {bad}; expected one of {FINISH_REASONS}")
        if n and int(self.response_lengths.max()) > self.response_ids.shape[1]:
            raise ValueError("RolloutBatch.response_lengths exceed the padded width of response_ids")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    def response_mask(self) -> torch.Tensor:
        """BoolTensor [N, R]: True on the valid (non-padding) response positions."""
        width = self.response_ids.shape[1]
        return torch.arange(width).unsqueeze(0) < self.response_lengths.unsqueeze(1)

    def train_mask(self) -> torch.Tensor:
        """BoolTensor [N, R]: the positions a trainer learns from: the model's own valid tokens (response_mask() and
        loss_mask)."""
        mask = self.response_mask()
        return mask if self.loss_mask is None else mask & self.loss_mask

    def model_token_counts(self) -> torch.Tensor:
        """LongTensor [N]: tokens each sample's model generated (tool and template tokens not counted)."""
        return self.train_mask().sum(dim=1)

    def response(self, i: int) -> list[int]:
        """The response tokens of sample i, without padding."""
        return self.response_ids[i, : int(self.response_lengths[i])].tolist()

    def logprobs(self, i: int) -> list[float]:
        """The rollout logprobs of sample i, without padding."""
        if self.rollout_logprobs is None:
            raise ValueError("this batch was generated without logprobs (rollout.calculate_log_probs=False)")
        return self.rollout_logprobs[i, : int(self.response_lengths[i])].tolist()

    def select(self, indices: list[int]) -> "RolloutBatch":
        """The samples at `indices` (e.g. after dynamic-sampling filters), padding width kept."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[i] for i in indices], response_ids=self.response_ids[idx],
            response_lengths=self.response_lengths[idx],
            rollout_logprobs=None if self.rollout_logprobs is None else self.rollout_logprobs[idx],
            finish_reasons=[self.finish_reasons[i] for i in indices], truncated=self.truncated[idx],
            prompt_index=self.prompt_index[idx], prompt_truncated=self.prompt_truncated[idx],
            weight_version=self.weight_version, pad_token_id=self.pad_token_id, metrics=dict(self.metrics),
            token_versions=None if self.token_versions is None else self.token_versions[idx],
            loss_mask=None if self.loss_mask is None else self.loss_mask[idx],
            tool_rewards=None if self.tool_rewards is None else self.tool_rewards[idx],
            routed_experts=None if self.routed_experts is None else self.routed_experts[idx])

    @classmethod
    def concat(cls, batches: list["RolloutBatch"], prompt_index: Optional[list[int]] = None) -> "RolloutBatch":
        """One batch from several (responses re-padded to the widest); `prompt_index` gives each input batch's samples
        a new group id (default: keep the ids). Metrics are summed where they are counts, else taken from the last."""
        width = max(b.response_ids.shape[1] for b in batches)
        pad = batches[0].pad_token_id

        def widen(t: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        groups = [b.prompt_index if prompt_index is None else torch.full_like(b.prompt_index, prompt_index[k])
                  for k, b in enumerate(batches)]
        logprobs = None if batches[0].rollout_logprobs is None else torch.cat(
            [widen(b.rollout_logprobs, 0.0) for b in batches])
        versions = None if any(b.token_versions is None for b in batches) else torch.cat(
            [widen(b.token_versions, 0) for b in batches])
        multi_turn = any(b.loss_mask is not None for b in batches)
        # a batch without a loss mask is all model tokens; without tool rewards, zeros
        loss_mask = torch.cat([widen(b.loss_mask if b.loss_mask is not None else b.response_mask(), False)
                               for b in batches]) if multi_turn else None
        tool_rewards = torch.cat([b.tool_rewards if b.tool_rewards is not None else torch.zeros(len(b))
                                  for b in batches]) if any(b.tool_rewards is not None for b in batches) else None
        routes = None
        if all(b.routed_experts is not None for b in batches):  # positions widened with -1 (no route)
            w = max(b.routed_experts.shape[1] for b in batches)
            grow = torch.nn.functional.pad
            routes = torch.cat([grow(b.routed_experts, (0, 0, 0, 0, 0, w - b.routed_experts.shape[1]), value=-1)
                                for b in batches])
        return cls(prompt_ids=[p for b in batches for p in b.prompt_ids],
                   response_ids=torch.cat([widen(b.response_ids, pad) for b in batches]),
                   response_lengths=torch.cat([b.response_lengths for b in batches]), rollout_logprobs=logprobs,
                   finish_reasons=[r for b in batches for r in b.finish_reasons],
                   truncated=torch.cat([b.truncated for b in batches]), prompt_index=torch.cat(groups),
                   prompt_truncated=torch.cat([b.prompt_truncated for b in batches]),
                   weight_version=batches[-1].weight_version, pad_token_id=pad, metrics=dict(batches[-1].metrics),
                   token_versions=versions,
                   loss_mask=loss_mask, tool_rewards=tool_rewards, routed_experts=routes)
