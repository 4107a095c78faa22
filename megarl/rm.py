"""Reward-model training from preference pairs (`megarl rm RECIPE`), on the machinery SFT and the critic use.

Data: rows with a prompt (data.prompt_key: chat messages or text) and two responses, rm.chosen_key (preferred) and
rm.rejected_key (text or assistant messages). Each side is encoded as the reward model will read it during RL
(megarl.reward.model.encode_side: prompt with the generation prompt, response, EOS).

Model: rm.model_path (default: the SFT output when sft.enable, trained first if missing; else model.path) with its
LM head replaced by a one-output score head (or a *ForSequenceClassification's own head), megatron at the recipe's
TP/PP layout, data parallel over the rest.

Loss: Bradley-Terry, -log sigmoid(r(chosen) - r(rejected)) averaged over the step's pairs, r read at each side's last
token. A pair's two sides sit in adjacent rows of one micro-batch, so any micro-batch size and DP split keep pairs
whole. Reported: train loss, pair accuracy and margin; held-out pair accuracy (share with r(chosen) > r(rejected)) and
margin (mean r(chosen) - r(rejected)) every rm.eval_freq steps and at the end (rm/val_accuracy, rm/val_margin in
<run_dir>/rm/metrics.jsonl).

Output: an HF *ForSequenceClassification directory (num_labels 1, `score.weight`, pad_token_id set) at rm.output_dir,
which transformers' AutoModelForSequenceClassification and reward.reward_model.path load. Checkpoints (resume) go to
<run_dir>/rm/checkpoints with checkpoint.save_freq / checkpoint.resume as in RL.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.config import MegarlConfig
from megarl.metrics import MetricsLogger
from megarl.config.outputs import pair_paths, rm_output_dir

log = logging.getLogger("megarl")






def write_synthetic_pairs(cfg: MegarlConfig) -> None:
    from megarl.data import write_dataset
    from megarl.data.synthetic import make_arithmetic_preferences

    syn = cfg.data.synthetic
    for split, path in pair_paths(cfg).items():
        if path.exists():
            continue
        n = syn.num_train if split == "train" else syn.num_val
        seed = cfg.trainer.seed + (30_000 if split == "train" else 40_000)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_dataset(make_arithmetic_preferences(n, seed, syn.max_operand, syn.answer_format, split), str(path))
        log.info("rm: wrote %d synthetic preference pairs to %s", n, path)


def load_pairs(files: list[str], cfg: MegarlConfig, setting: str) -> list[tuple]:
    """[(prompt, chosen, rejected)] from preference files."""
    from megarl.data import load_prompts

    d, r = cfg.data, cfg.rm
    sides = [load_prompts(files, setting=setting, prompt_key=d.prompt_key, response_key=key,
                          ground_truth_key=d.ground_truth_key, data_source_key=d.data_source_key,
                          extra_info_key=d.extra_info_key, require_ground_truth=False, require_response=True)
             for key in (r.chosen_key, r.rejected_key)]
    return [(c.prompt, c.response, rj.response) for c, rj in zip(*sides)]


def encode_pairs(pairs, tokenizer, max_length: int, apply_chat_template: bool) -> list[tuple[list[int], list[int]]]:
    from megarl.reward.model import encode_side

    out, cut = [], 0
    for prompt, chosen, rejected in pairs:
        c, cut_c = encode_side(prompt, chosen, tokenizer, apply_chat_template, max_length)
        r, cut_r = encode_side(prompt, rejected, tokenizer, apply_chat_template, max_length)
        cut += cut_c or cut_r
        out.append((c, r))
    if cut:
        log.warning("rm: %d of %d pairs were cut to rm.max_length=%d", cut, len(pairs), max_length)
    return out


def pair_batch(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids [2P, S] right-padded, rows 2i / 2i+1 = pair i's chosen / rejected side; lengths [2P] up to the
    scored token (pad_id is the exported model's pad_token_id: HF's rule, see reward.model.score_length)."""
    from megarl.reward.model import pad_rows

    ids, lengths = pad_rows([side for pair in pairs for side in pair], pad_id, score_pad_id=pad_id)
    return {"input_ids": ids, "lengths": lengths}


@dataclass(frozen=True, eq=False)
class BradleyTerryLoss:
    """(micro_batch, values [1, P, 1] of its pack) -> (Bradley-Terry loss share, metrics) for train_mini_batch
    (center_coef: bt_loss's reward-centering weight)."""

    denominator: torch.Tensor
    center_coef: float = 0.0

    def __call__(self, mb: dict, out: torch.Tensor):
        from megarl.megatron.packing import row_values
        from megarl.reward.model import bt_loss, last_token_scores

        scores = last_token_scores(row_values(out, mb["pack"]), mb["lengths"])
        loss, metrics = bt_loss(scores[0::2], scores[1::2], self.denominator, self.center_coef)
        return loss, {"bt_loss": loss.detach(), **metrics}


def prompt_groups(pairs: list[tuple]) -> list[int]:
    """Each pair's prompt group (pairs with the same prompt share one): [(prompt, chosen, rejected)] -> [P] ids."""
    keys: dict[str, int] = {}
    return [keys.setdefault(json.dumps(prompt, sort_keys=True), len(keys)) for prompt, _, _ in pairs]


def top1_accuracy(scores: torch.Tensor, pairs: list[tuple[list[int], list[int]]], groups: list[int]) -> float:
    """Share of prompts whose highest-scored response is a preferred one: one that none of the prompt's pairs
    rejects. scores [2P]: rows 2i / 2i+1 score pair i's chosen / rejected side. On pairs of the policy's samples
    (rm.policy_pairs) this is how often the reward model ranks a right sample first among the policy's answers."""
    best: dict[int, tuple[float, tuple]] = {}
    rejected: dict[int, set] = {}
    for i, (chosen, rej) in enumerate(pairs):
        g = groups[i]
        rejected.setdefault(g, set()).add(tuple(rej))
        for side, row in ((tuple(chosen), 2 * i), (tuple(rej), 2 * i + 1)):
            value = float(scores[row])
            if g not in best or value > best[g][0]:
                best[g] = (value, side)
    hits = [best[g][1] not in rejected[g] for g in best]
    return sum(hits) / len(hits) if hits else float("nan")


def evaluate(worker, pairs, pad_id: int, rt, groups=None, name: str = "val") -> dict:
    """Held-out pair accuracy and margin, and top-1 accuracy when the pairs' prompt groups are given (collective;
    every rank returns them). Keys rm/<name>_accuracy, ..."""
    if not pairs:
        return {}
    batch = pair_batch(pairs, pad_id)
    scores = worker.scores(batch["input_ids"], batch["lengths"], rt)
    diff = scores[0::2] - scores[1::2]
    out = {f"rm/{name}_accuracy": float((diff > 0).float().mean()), f"rm/{name}_margin": float(diff.mean()),
           f"rm/{name}_chosen_mean": float(scores[0::2].mean()), f"rm/{name}_rejected_mean": float(scores[1::2].mean()),
           # what a verifier thresholding the score at 0 gets right: chosen sides above 0, rejected ones below
           f"rm/{name}_sign_accuracy": float(torch.cat([scores[0::2] > 0, scores[1::2] < 0]).float().mean())}
    if groups is not None:
        out[f"rm/{name}_top1"] = top1_accuracy(scores, pairs, groups)
    return out


def evaluate_all(worker, held_out: dict, pad_id: int, rt) -> dict:
    """evaluate() over the named held-out sets {name: (pairs, groups)}."""
    out: dict = {}
    for name, (pairs, groups) in held_out.items():
        out.update(evaluate(worker, pairs, pad_id, rt, groups, name))
    return out


def _micro_batches(batch: dict, pairs_per_micro: int) -> list[dict]:
    """Micro-batches of whole pairs, each cut to its own longest row."""
    rows = 2 * pairs_per_micro
    out = []
    for i in range(0, batch["input_ids"].shape[0], rows):
        lengths = batch["lengths"][i:i + rows]
        out.append({"input_ids": batch["input_ids"][i:i + rows, : int(lengths.max())], "lengths": lengths})
    return out


def reward_model_config(source: Path, pad_token_id, dtype: torch.dtype) -> dict:
    """config.json of the exported reward model: the source's, as *ForSequenceClassification with one label."""
    cfg = json.loads((source / "config.json").read_text())
    arch = cfg["architectures"][0]
    name = str(dtype).replace("torch.", "")
    cfg.update(architectures=[arch.replace("ForCausalLM", "ForSequenceClassification")], num_labels=1,
               id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, tie_word_embeddings=False, torch_dtype=name,
               dtype=name)
    if pad_token_id is not None:  # HF pools the last token that is not padding: it needs to know the pad id
        cfg["pad_token_id"] = pad_token_id
    return cfg


def rm_init_path(cfg: MegarlConfig, rt) -> str:
    from megarl.sft import sft_model_path

    if cfg.rm.model_path:
        return cfg.rm.model_path
    return sft_model_path(cfg, rt) if cfg.sft.enable else cfg.model.path


def run_rm(cfg: MegarlConfig, rt, policy_files: dict | None = None, init: str | None = None) -> tuple[Path, dict]:
    """Train the reward model and write it; returns (output dir, final held-out metrics). policy_files: {"train",
    "val"} pair files of the policy's samples (rm.policy_pairs), added to the training pairs and held out as
    rm/policy_val_*. init: the model it starts from (None: rm_init_path)."""
    from transformers import AutoTokenizer

    from megarl.checkpoint.state import Checkpointer
    from megarl.data import PromptLoader
    from megarl.megatron.train_step import global_count, train_mini_batch
    from megarl.reward.model import RewardModelWorker
    from megarl.checkpoint.hf_writer import write_hf_model
    from megarl.distributed import dp_row_range

    r = cfg.rm
    init = init or rm_init_path(cfg, rt)
    policy_files = policy_files or {}
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or init,
                                              trust_remote_code=cfg.model.trust_remote_code)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = encode_pairs(load_pairs(r.train_files, cfg, "rm.train_files"), tokenizer, r.max_length,
                         cfg.data.apply_chat_template)
    held_out = {}  # name -> (encoded pairs, prompt groups)
    if r.val_files:
        raw = load_pairs(r.val_files, cfg, "rm.val_files")
        held_out["val"] = (encode_pairs(raw, tokenizer, r.max_length, cfg.data.apply_chat_template),
                           prompt_groups(raw))
    else:  # a fixed, seeded hold-out
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.trainer.seed)).tolist()
        held = int(len(train) * r.val_fraction)
        held_out["val"] = ([train[i] for i in order[:held]], None)
        train = [train[i] for i in order[held:]]
    for name, files in policy_files.items():  # the policy's own samples (rm.policy_pairs)
        raw = load_pairs([str(files)], cfg, f"rm.policy_pairs ({name})")
        encoded = encode_pairs(raw, tokenizer, r.max_length, cfg.data.apply_chat_template)
        if name == "train":
            train = train + encoded
        else:
            held_out["policy_val"] = (encoded, prompt_groups(raw))
    per_rank = r.batch_size // rt.dp_size
    if r.batch_size % rt.dp_size or per_rank % min(r.micro_batch_size_per_gpu, per_rank):
        raise ValueError(f"rm.batch_size={r.batch_size} pairs must split over {rt.dp_size} data-parallel ranks into "
                         f"micro-batches of rm.micro_batch_size_per_gpu={r.micro_batch_size_per_gpu}; make it a "
                         "multiple of both")
    loader = PromptLoader(train, seed=cfg.trainer.seed, shuffle=True, drop_last=True)
    total = r.total_steps or r.epochs * loader.batches_per_epoch(r.batch_size)
    worker = RewardModelWorker(init, cfg, optim=r.optim, total_steps=total,
                               micro_batch_size=2 * r.micro_batch_size_per_gpu)
    run_dir = Path(cfg.trainer.run_dir) / "rm"
    ckpt_cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_dir": str(run_dir),
                                                                                "total_steps": total})})
    ckpt = Checkpointer(ckpt_cfg, rt, models={"reward_model": worker}, states={"loader": loader})
    start = ckpt.resume()
    logger = MetricsLogger(run_dir, enabled=rt.is_rank0, tensorboard=cfg.logging.tensorboard,
                           console=cfg.logging.console, total_steps=total, summary=False, resume_step=start)
    log.info("rm: %d training pairs, %d held out, %d steps of %d pairs, from %s", len(train),
             sum(len(p) for p, _ in held_out.values()), total, r.batch_size, init)
    if not start:
        logger.log(0, evaluate_all(worker, held_out, pad, rt))
    final: dict = {}
    for step in range(start + 1, total + 1):
        batch = pair_batch(loader.next_batch(r.batch_size), pad)
        rows = dp_row_range(2 * r.batch_size, rt)
        mine = {k: v[rows] for k, v in batch.items()}
        micro = _micro_batches(mine, min(r.micro_batch_size_per_gpu, per_rank))
        denominator = global_count(torch.tensor(per_rank))
        m = train_mini_batch(worker.trainable, micro, BradleyTerryLoss(denominator, r.center_rewards_coefficient))
        metrics = {"rm/loss": m["bt_loss"], "rm/accuracy": m["accuracy"], "rm/margin": m["margin"],
                   "rm/center": m["center"],
                   "rm/grad_norm": m["grad_norm"], "rm/lr": m["lr"]}
        if step == total or (r.eval_freq and step % r.eval_freq == 0):
            final = evaluate_all(worker, held_out, pad, rt)
            metrics.update(final)
        if step % max(1, total // 20) == 0 or step in (1, total) or "rm/val_accuracy" in metrics:
            logger.log(step, metrics)
        if ckpt.after_step(step):
            break
    ckpt.close()
    if start >= total:  # resumed a finished run: measure the model as it is
        final = evaluate_all(worker, held_out, pad, rt)
    logger.close()
    out = rm_output_dir(cfg)
    buckets = worker.export(cfg.rollout.update_weights_bucket_megabytes << 20)
    if rt.is_rank0:
        write_hf_model(buckets, init, out)
        dtype = next(worker.chunks[0].parameters()).dtype
        (out / "config.json").write_text(json.dumps(reward_model_config(Path(init), pad, dtype), indent=2))
        if cfg.model.tokenizer_path:  # the reward model reads with the tokenizer it was trained with
            tokenizer.save_pretrained(str(out))
        policy = (f"; the policy's samples: pair accuracy {final['rm/policy_val_accuracy']:.3f}, top-1 "
                  f"{final['rm/policy_val_top1']:.3f}" if "rm/policy_val_accuracy" in final else "")
        log.info("rm: held-out pair accuracy %.3f, margin %.3f%s; wrote %s", final.get("rm/val_accuracy", float("nan")),
                 final.get("rm/val_margin", float("nan")), policy, out)
    else:
        for _ in buckets:
            pass
    torch.distributed.barrier()
    return out, final


def rm_entry(cfg_dict: dict) -> str:
    """`megarl rm`: prepare inputs (synthetic pairs, a tiny model), train the reward model, write it."""
    from megarl.config import write_resolved
    from megarl.prepare import prepare
    from megarl.distributed import barrier
    from megarl.runtime import start

    cfg = MegarlConfig.model_validate(cfg_dict)
    rt = start(cfg)
    cfg = prepare(cfg, rt.is_rank0)
    if not cfg.rm.train_files and cfg.data.synthetic is not None:
        if rt.is_rank0:
            write_synthetic_pairs(cfg)
        paths = pair_paths(cfg)
        cfg = cfg.model_copy(update={"rm": cfg.rm.model_copy(update={
            "train_files": [str(paths["train"])], "val_files": cfg.rm.val_files or [str(paths["val"])]})})
    policy_files = {}
    init = rm_init_path(cfg, rt)  # SFT first when missing
    if cfg.rm.policy_pairs.enable:  # sample the policy the reward model starts from
        from megarl.rm_data import policy_pair_paths, write_policy_pairs

        if rt.is_rank0:
            write_policy_pairs(cfg, init)
        policy_files = {k: v for k, v in policy_pair_paths(cfg).items() if k == "train" or cfg.data.val_files}
    barrier()
    if rt.is_rank0:
        write_resolved(cfg)
    return str(run_rm(cfg, rt, policy_files, init)[0])
