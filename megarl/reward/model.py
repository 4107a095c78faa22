"""Discriminative reward models on megatron: the Bradley-Terry loss, the sequence encoding and the scorer.

A reward model is the critic's model: the megatron trunk with a replicated one-output head (megarl.megatron.model
ValueHead), loaded from / exported as an HF *ForSequenceClassification (num_labels 1) with `score.weight`. Its score of
a sequence is the head's output at the sequence's last token that is not the model's pad_token_id, which is what HF's
*ForSequenceClassification returns (score_length).

    scorer = RewardModelScorer(cfg.reward.reward_model.path, cfg, policy_tokenizer)
    scores = scorer.score(rollout, records, rt)            # [N] float32 on every rank (collective)

Encoding. A sample is encoded as `megarl rm` encodes a pair's side (`encode_side`): the prompt as the data loader
encodes it (the chat template with the generation prompt, or the plain text), then the response's tokens and EOS. When
the reward model's tokenizer is the policy's (same vocabulary and chat template), the policy's own ids are scored
(prompt ids + response ids, EOS included when the response stopped on it). Otherwise the response is decoded and the
sample re-encoded with the reward model's tokenizer and chat template (what verl does for a reward model with another
tokenizer).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F


def bt_loss(chosen: torch.Tensor, rejected: torch.Tensor, denominator: Optional[torch.Tensor] = None,
            center_coef: float = 0.0):
    """Bradley-Terry loss of pairs: sum_i [-log sigmoid(chosen_i - rejected_i) + center_coef * (chosen_i +
    rejected_i)^2] / denominator (default: the number of pairs). chosen, rejected: [P] scores. Returns (loss,
    {"accuracy": share of pairs with chosen > rejected, "margin": mean chosen - rejected, "center": mean chosen +
    rejected}) (metrics detached, over these P pairs).

    center_coef > 0 is the reward-centering term of Eisenstein et al. 2023 (TRL's `center_rewards_coefficient`): the
    Bradley-Terry loss sees only differences, so each prompt's scores may float by an offset of their own; pulling
    every pair's sum towards 0 puts a prompt's preferred answers above 0 and the others below, whatever the prompt,
    which a fixed threshold on the score (a verifier) needs."""
    diff = chosen.float() - rejected.float()
    denominator = torch.as_tensor(diff.numel() if denominator is None else denominator, dtype=diff.dtype,
                                  device=diff.device)
    total = chosen.float() + rejected.float()
    per_pair = -F.logsigmoid(diff)
    if center_coef:
        per_pair = per_pair + center_coef * total.square()
    loss = per_pair.sum() / denominator
    return loss, {"accuracy": (diff > 0).float().mean().detach(), "margin": diff.mean().detach(),
                  "center": total.mean().detach()}


def last_token_scores(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Scores [b] from per-token head outputs values [b, S] (or [b, S, 1]) at each row's last real token
    (lengths [b] >= 1: real tokens of each right-padded row)."""
    if values.dim() == 3:
        values = values[..., 0]
    index = (lengths.to(values.device).long() - 1).clamp(min=0)
    return values.float().gather(1, index[:, None]).squeeze(1)


def encode_side(prompt: Any, response: Any, tokenizer, apply_chat_template: bool = True,
                max_length: Optional[int] = None) -> tuple[list[int], bool]:
    """(ids, cut) of prompt + response as a reward model reads it: the prompt's ids (chat template with the
    generation prompt for messages, the plain text otherwise), then the response's tokens and EOS. A response given as
    assistant messages is their contents joined by newlines. Beyond max_length the start of the prompt is cut (the
    response and the last token, where the score is read, are kept); `cut` says so."""
    from megarl.data import PromptRecord, encode_one

    if not isinstance(response, str):
        response = "\n".join(m["content"] for m in response if m.get("role", "assistant") == "assistant")
    prompt_ids = encode_one(PromptRecord(index=0, uid="", prompt=prompt), tokenizer, apply_chat_template)
    ids = prompt_ids + tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    cut = max_length is not None and len(ids) > max_length
    return (ids[-max_length:] if cut else ids), cut


def score_length(row: Sequence[int], pad_token_id: Optional[int]) -> int:
    """1 + the position a reward model reads its score at: HF *ForSequenceClassification's rule, the last token that
    is not the config's pad_token_id (the last token when it has none). Where EOS is the pad token, that is the token
    before a final EOS."""
    if pad_token_id is not None:
        for i in range(len(row) - 1, -1, -1):
            if row[i] != pad_token_id:
                return i + 1
        return 1
    return len(row)


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, score_pad_id: Optional[int] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [N, S] right-padded with pad_id, lengths [N]: score_length of each row under score_pad_id, the
    reward model's pad_token_id; None: the rows' lengths)."""
    s = max(len(r) for r in rows)
    ids = torch.full((len(rows), s), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
    return ids, torch.tensor([score_length(r, score_pad_id) for r in rows], dtype=torch.long)


def same_tokenizer(a, b) -> bool:
    """Whether ids of tokenizer a mean the same text to tokenizer b: the same vocabulary, special tokens and chat
    template (then the policy's ids can be scored as they are)."""
    if a is b:
        return True
    return (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None))


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def sample_rows(rollout, records, policy_tokenizer, rm_tokenizer, apply_chat_template: bool,
                max_length: Optional[int]) -> tuple[list[list[int]], int]:
    """Each sample's ids for the reward model and how many were cut to max_length. The policy's ids when the
    tokenizers agree (see the module docstring), else decoded and re-encoded with the reward model's template."""
    rows, cut = [], 0
    same = same_tokenizer(policy_tokenizer, rm_tokenizer)
    for i in range(len(rollout)):
        if same:
            ids = list(rollout.prompt_ids[i]) + list(rollout.response(i))
            was_cut = max_length is not None and len(ids) > max_length
            ids = ids[-max_length:] if was_cut else ids
        else:
            rec = records[int(rollout.prompt_index[i])]
            text = policy_tokenizer.decode(list(rollout.response(i)), skip_special_tokens=True)
            ids, was_cut = encode_side(rec.prompt, text, rm_tokenizer, apply_chat_template, max_length)
        rows.append(ids)
        cut += was_cut
    return rows, cut


class RewardModelWorker:
    """This rank's shard of a reward model (value head) at the trainer's layout; trainable when `optim` is given
    (`megarl rm`), frozen otherwise (scoring during RL)."""

    def __init__(self, hf_dir: str, cfg, optim=None, total_steps: int = 1, micro_batch_size: int = 4):
        from megarl.megatron.model import build_and_load
        from megarl.megatron.train_step import make_trainable
        from megarl.megatron.workers import build_options

        # a causal-LM checkpoint has no score.weight: the head then starts N(0, 1/(hidden+1)), seeded
        self.model, self.spec = build_and_load(hf_dir, value_head=True, head_seed=cfg.trainer.seed,
                                               **build_options(cfg))
        self.trainable = make_trainable(self.model, optim, total_steps,
                                        cfg.parallelism.use_distributed_optimizer) if optim is not None else None
        if self.trainable is None:
            for chunk in (self.model if isinstance(self.model, list) else [self.model]):  # virtual stages: chunks
                chunk.eval()
                for p in chunk.parameters():
                    p.requires_grad_(False)
        self.micro_batch_size = micro_batch_size

    @property
    def chunks(self):
        if self.trainable:
            return self.trainable.chunks
        return self.model if isinstance(self.model, list) else [self.model]

    def scores(self, input_ids: torch.Tensor, lengths: torch.Tensor, rt) -> torch.Tensor:
        """Scores [N] float32 (CPU) of right-padded input_ids [N, S] with `lengths` [N], on every rank (collective:
        each DP rank computes its rows, N padded up to a multiple of DP)."""
        from megarl.megatron.forward import token_values
        from megarl.distributed import dp_row_range, gather_model_output

        n = input_ids.shape[0]
        extra = -n % rt.dp_size
        if extra:  # repeat the first row: its scores are dropped below
            input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
            lengths = torch.cat([lengths, lengths[:1].expand(extra)])
        rows = dp_row_range(input_ids.shape[0], rt)
        mine = input_ids[rows]
        micro = max(1, min(self.micro_batch_size, mine.shape[0]))
        values = token_values(self.chunks, mine, micro, lengths=lengths[rows])
        local = None if values is None else last_token_scores(values, lengths[rows])[:, None]
        return gather_model_output(local, (rows.stop - rows.start, 1))[:n, 0]

    def export(self, bucket_bytes: int):
        from megarl.bridge.exporter import export_hf_weights

        return export_hf_weights(self.chunks, self.spec, bucket_bytes)


class RewardModelScorer:
    """reward.reward_model during RL: the frozen reward model and its tokenizer."""

    def __init__(self, cfg, policy_tokenizer):
        from transformers import AutoTokenizer

        rm = cfg.reward.reward_model
        self.cfg = cfg
        self.policy_tokenizer = policy_tokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(rm.path, trust_remote_code=cfg.model.trust_remote_code)
        self.worker = RewardModelWorker(rm.path, cfg, micro_batch_size=rm.micro_batch_size_per_gpu)
        config = json.loads((Path(rm.path) / "config.json").read_text())
        self.score_pad_id = config.get("text_config", config).get("pad_token_id")
        self.reencodes = not same_tokenizer(policy_tokenizer, self.tokenizer)

    def score(self, rollout, records, rt) -> tuple[torch.Tensor, dict]:
        """([N] scores on every rank, metrics). Collective."""
        rm = self.cfg.reward.reward_model
        rows, cut = sample_rows(rollout, records, self.policy_tokenizer, self.tokenizer,
                                self.cfg.data.apply_chat_template, rm.max_length)
        ids, lengths = pad_rows(rows, _pad_id(self.tokenizer), self.score_pad_id)
        scores = self.worker.scores(ids, lengths, rt)
        return scores, {"reward/reward_model_cut": float(cut)}
