"""Supervised fine-tuning on prompt/response data, on the same megatron machinery as RL (`megarl sft RECIPE`).

The loss is the token-mean NLL of the response tokens (and the EOS that closes them); the prompt is context only.
The result is written as a Hugging Face model directory (sft.output_dir), which an RL recipe starts from.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from megarl.config import MegarlConfig
from megarl.data import PromptLoader, encode_one, load_prompts
from megarl.metrics import MetricsLogger
from megarl.prepare import flat_settings, note_reuse, record_made
from megarl.config.outputs import sft_output_dir

log = logging.getLogger("megarl")




def sft_settings(cfg: MegarlConfig) -> dict:
    """What decides the SFT model's weights (the data's own settings are recorded with the data)."""
    return {"trainer.seed": cfg.trainer.seed, "model.path": str(cfg.model.path),
            **flat_settings("sft", cfg.sft, ("enable", "output_dir", "train_files"))}


def sft_model_path(cfg: MegarlConfig, rt) -> str:
    """The SFT model a recipe with sft.enable starts from: trained when sft_output_dir is missing, else reused (said
    on rank 0, with a warning where it was made with other settings)."""
    path = sft_output_dir(cfg)
    if not path.exists():
        return str(run_sft(cfg, rt))
    if rt.is_rank0:
        note_reuse(path, sft_settings(cfg), "sft", "sft.output_dir")
    return str(path)


def _response_ids(response, tokenizer, renderer) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of an SFT target after the prompt. A string: its tokens and EOS, all trained. A list of
    assistant/tool messages (a multi-turn demonstration): each assistant message's tokens and EOS (trained), each run
    of tool messages as the chat template's tool turn, the ids the multi-turn rollout appends (not trained)."""
    eos = tokenizer.eos_token_id
    if isinstance(response, str):
        ids = tokenizer.encode(response, add_special_tokens=False) + [eos]
        return ids, [1] * len(ids)
    ids, mask, last, tools = [], [], [], []
    for message in list(response) + [None]:
        if (message is None or message["role"] == "assistant") and tools:
            turn = renderer.tool_turn(last, tools)
            ids, mask, tools = ids + turn, mask + [0] * len(turn), []
        if message is None:
            break
        if message["role"] == "tool":
            tools.append(message["content"])
            continue
        last = tokenizer.encode(message["content"], add_special_tokens=False) + [eos]
        ids, mask = ids + last, mask + [1] * len(last)
    return ids, mask


def encode_sft(records, tokenizer, max_length: int, apply_chat_template: bool, images=None
               ) -> list[tuple[list[int], list[int], tuple]]:
    """(prompt + response token ids, loss mask over them: 1 on trained tokens, the record's images) per record, cut to
    max_length (counted in the log). A response is a string, or assistant/tool messages (tool turns are context, not
    trained). images: a megarl.data.vision.ImagePrompts, which encodes a prompt with images (each `<image>` its
    placeholder run); such a prompt is never cut (its image would lose tokens)."""
    from megarl.agent.render import ChatRenderer

    out, cut = [], 0
    renderer = ChatRenderer(tokenizer) if any(isinstance(r.response, list) for r in records) else None
    for rec in records:
        if rec.images:
            if images is None:
                raise ValueError(f"SFT example {rec.uid} has images but the model reads text only")
            prompt = images.prompt_ids(rec, apply_chat_template)
            if len(prompt) >= max_length:
                raise ValueError(f"SFT example {rec.uid}: its prompt with its image tokens is {len(prompt)} tokens, "
                                 f"which sft.max_length={max_length} would cut into; raise sft.max_length")
        else:
            prompt = encode_one(rec, tokenizer, apply_chat_template)
        response, trained = _response_ids(rec.response, tokenizer, renderer)
        ids, mask = (prompt + response)[:max_length], ([0] * len(prompt) + trained)[:max_length]
        cut += len(prompt) + len(response) > max_length
        if any(mask):
            out.append((ids, mask, tuple(rec.images)))
    if cut:
        log.warning("sft: %d of %d examples were cut to sft.max_length=%d", cut, len(records), max_length)
    if not out:
        raise ValueError(f"no SFT example has a response token within sft.max_length={max_length}; raise it")
    return out


def sft_batch(examples: list[tuple], pad_id: int, images=None) -> dict[str, torch.Tensor]:
    """input_ids [B, S] right-padded; response_mask [B, S-1] True where the next token is a trained token; with images
    (an ImagePrompts) and examples that have some, the rows' pixel_values [B, P_max, patch_dim] and image_grid_thw
    [B, I_max, 3] (megarl.batching.VISION_KEYS), which the packed forward places at each row's placeholders."""
    s = max(len(ex[0]) for ex in examples)
    ids = torch.full((len(examples), s), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), s - 1, dtype=torch.bool)
    for i, (seq, trained, *_) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq) - 1] = torch.tensor(trained[1:], dtype=torch.bool)
    batch = {"input_ids": ids, "response_mask": mask}
    if images is not None:
        batch.update(images.rows_images([ex[2] if len(ex) > 2 else () for ex in examples]))
    return batch


def reached_target(losses: Sequence[float], target: Optional[float], window: int) -> bool:
    """sft.target_loss: whether the mean of the last `window` step losses is at or below `target` (never with fewer
    than `window` steps, nor without a target)."""
    return target is not None and len(losses) >= window and sum(losses[-window:]) / window <= target


def run_sft(cfg: MegarlConfig, rt) -> Path:
    """Train cfg.model.path on cfg.sft.train_files and write the result to sft_output_dir(cfg)."""
    from transformers import AutoTokenizer

    from megarl.batching import split_micro
    from megarl.checkpoint.hf_writer import write_hf_model
    from megarl.megatron.losses import SftLoss
    from megarl.megatron.train_step import loss_denominator, train_mini_batch
    from megarl.megatron.workers import PolicyWorker
    from megarl.distributed import dp_row_range

    s, d = cfg.sft, cfg.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    records = load_prompts(s.train_files, setting="sft.train_files", prompt_key=d.prompt_key,
                           response_key=d.response_key, ground_truth_key=d.ground_truth_key,
                           data_source_key=d.data_source_key, extra_info_key=d.extra_info_key,
                           image_key=d.image_key, require_ground_truth=False, require_response=True)
    images = None
    if any(r.images for r in records):
        from megarl.data.vision import ImagePrompts

        images = ImagePrompts(cfg.model.path, tokenizer)
    examples = encode_sft(records, tokenizer, s.max_length, d.apply_chat_template, images)
    loader = PromptLoader(examples, seed=cfg.trainer.seed, shuffle=True, drop_last=True)
    total = s.total_steps or s.epochs * loader.batches_per_epoch(s.batch_size)
    worker = PolicyWorker(cfg.model.path, cfg, trainable=True, optim=s.optim, total_steps=total,
                          use_lora=False)  # the warm start trains the whole model
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    logger = MetricsLogger(Path(cfg.trainer.run_dir) / "sft", enabled=rt.is_rank0, tensorboard=cfg.logging.tensorboard,
                           console=cfg.logging.console, total_steps=total, summary=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    log.info("sft: %d examples, %s%d steps of %d sequences", len(examples), "at most " if s.target_loss else "",
             total, s.batch_size)
    losses: list[float] = []
    for step in range(1, total + 1):
        batch = sft_batch(loader.next_batch(s.batch_size), pad, images)
        mine = {k: v[dp_row_range(s.batch_size, rt)] for k, v in batch.items()}
        micro_batches = split_micro(mine, min(micro, mine["input_ids"].shape[0]))
        denominator = loss_denominator([m["response_mask"] for m in micro_batches], "token-mean")
        metrics = train_mini_batch(worker.trainable, micro_batches,
                                   SftLoss(worker.spec.vocab_size, denominator))
        losses.append(metrics["sft_loss"])
        done = _agreed(reached_target(losses, s.target_loss, s.target_loss_window))
        if step % max(1, total // 20) == 0 or step in (1, total) or done:
            logger.log(step, {"sft/loss": metrics["sft_loss"], "sft/grad_norm": metrics["grad_norm"],
                              "sft/lr": metrics["lr"]})
        if done:
            log.info("sft: mean loss of the last %d steps %.3f <= sft.target_loss %g at step %d of at most %d",
                     s.target_loss_window, sum(losses[-s.target_loss_window:]) / s.target_loss_window,
                     s.target_loss, step, total)
            break
    else:
        if s.target_loss is not None:
            window = min(len(losses), s.target_loss_window)
            log.warning("sft: stopped at the step cap (%d) with a mean loss of %.3f over the last %d steps, above "
                        "sft.target_loss %g: RL starts from a less formed model; raise sft.total_steps (or the "
                        "learning rate) to reach it", total, sum(losses[-window:]) / window, window, s.target_loss)
    logger.close()
    out = sft_output_dir(cfg)
    buckets = worker.export(cfg.rollout.update_weights_bucket_megabytes << 20)
    if rt.is_rank0:
        write_hf_model(buckets, cfg.model.path, out)
        record_made(out, sft_settings(cfg))
        log.info("sft: wrote %s", out)
    else:
        for _ in buckets:
            pass
    torch.distributed.barrier()
    return out


def _agreed(flag: bool) -> bool:
    """True on every rank when it is on any: the ranks stop at the same step whatever their float sums."""
    from megarl import distributed

    value = torch.tensor([1.0 if flag else 0.0], device=distributed.compute_device())
    distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def sft_entry(cfg_dict: dict) -> str:
    """`megarl sft`: prepare inputs, fine-tune, write the HF model; returns its path."""
    from megarl.config import write_resolved
    from megarl.prepare import prepare
    from megarl.distributed import barrier
    from megarl.runtime import start

    cfg = MegarlConfig.model_validate(cfg_dict)
    rt = start(cfg)
    cfg = prepare(cfg, rt.is_rank0)
    barrier()
    if rt.is_rank0:
        write_resolved(cfg)
    return str(run_sft(cfg, rt))
