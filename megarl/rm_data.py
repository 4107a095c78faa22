"""Preference pairs from the policy's own samples (rm.policy_pairs), the pairs a reward model for RL needs.

A reward model trained only on hand-made pairs (the right answer against any wrong one) learns to separate those, and
can still rank the mistakes the policy actually makes above its right answers: RL then climbs the reward model, not
the task (over-optimisation). The usual remedy in RLHF is to label the policy's own samples: here the model the reward
model starts from (the SFT policy that RL starts from) samples rm.policy_pairs.n responses per prompt with megarl's
vLLM engine, the rule (reward.reward_fn, or the data_source routing) scores each, and a best-scored response of a
prompt is paired with each worse one, the policy's most frequent mistakes first:

    prompt "What is 13 + 8 ?"   samples: "#### 21" x3, "#### 20" x4, "#### 22" x1
    pairs:  ("#### 21" > "#### 20"), ("#### 21" > "#### 22")

With add_reference the prompt's reference response (data.response_key) is one more candidate, scored like the samples,
so a prompt the policy never answers right still pairs the right answer with its mistakes. Prompts whose candidates
all score the same give no pair.

Train pairs come from data.train_files, held-out pairs from data.val_files (the prompts RL validates on); they are
written to <data dir>/policy_pairs_{train,val}.parquet with the chosen/rejected rule scores and sample counts in
extra_info, and built only when missing (delete them to rebuild). Sampling is seeded (trainer.seed), so the same
recipe writes the same pairs.
"""
from __future__ import annotations

import logging
from megarl.config.outputs import policy_pair_paths
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("megarl")

CHUNK_PROMPTS = 1024  # prompts per engine call: bounds the memory of one RolloutBatch




def response_text(response: Any) -> Any:
    """A reference response as text: a string as it is, a list of messages as its last assistant message."""
    if isinstance(response, list):
        said = [m["content"] for m in response if m.get("role") == "assistant"]
        return said[-1] if said else None
    return response


def pairs_for_prompt(candidates: Sequence[tuple[str, float]], reference: Any, reference_score: Any,
                     max_pairs: int) -> tuple[list[tuple[str, str, float, float]], dict]:
    """Pairs (chosen, rejected, chosen score, rejected score) of one prompt from its sampled (text, score) list.

    Candidates are the distinct sampled texts (and the reference, when given with its score). Every best-scored text is
    a chosen side, in turn; every text scoring below the best is a rejected side once, the most often sampled first
    (ties: text order), at most max_pairs pairs. Returns (pairs, {"samples_best": how many samples scored the best})."""
    counts = Counter(text for text, _ in candidates)
    score_of = {text: float(s) for text, s in candidates}
    if reference is not None and reference_score is not None:
        score_of.setdefault(reference, float(reference_score))
        counts.setdefault(reference, 0)
    if not score_of:
        return [], {"samples_best": 0}
    best = max(score_of.values())
    # chosen: the policy's own best answers first (most sampled), the reference last
    chosen = sorted((t for t, s in score_of.items() if s == best), key=lambda t: (-counts[t], t))
    rejected = sorted((t for t, s in score_of.items() if s < best), key=lambda t: (-counts[t], t))[:max_pairs]
    pairs = [(chosen[i % len(chosen)], r, best, score_of[r]) for i, r in enumerate(rejected)]
    return pairs, {"samples_best": sum(counts[t] for t in chosen)}


def build_policy_pairs(cfg, model_path: str, split: str) -> tuple[list[dict], dict]:
    """Rows of preference pairs from `model_path`'s samples on the split's prompts, and a summary
    {prompts, samples, sample_score_mean, prompts_with_best_sample, pairs}."""
    from transformers import AutoTokenizer

    from megarl.data import encode_prompts, load_prompts_from_config
    from megarl.reward.compute import RewardInput, compute_rewards
    from megarl.reward.registry import reward_fn_from_config
    from megarl.rollout.hosting.process import EngineProcess

    pp, r = cfg.rm.policy_pairs, cfg.reward
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    records = load_prompts_from_config(cfg.data, split, require_data_source=r.reward_fn is None)
    records, prompt_ids, _ = encode_prompts(records, tokenizer, cfg.rollout.prompt_length, cfg.data.truncation,
                                            cfg.data.apply_chat_template)
    reward_fn = reward_fn_from_config(r)
    engine_cfg = cfg.rollout.model_copy(update={"n": pp.n, "temperature": pp.temperature, "do_sample": True,
                                                "calculate_log_probs": False, "enable_sleep_mode": False})
    # its own seed per split, so train and held-out prompts do not share sample streams
    seed = cfg.trainer.seed + (50_000 if split == "train" else 60_000)
    engine = EngineProcess(engine_cfg, model_path, seed=seed, name="megarl-rm-data")
    texts: list[list[str]] = [[] for _ in records]
    try:
        for start in range(0, len(records), CHUNK_PROMPTS):
            part = prompt_ids[start:start + CHUNK_PROMPTS]
            batch = engine.generate(part, n=pp.n, prompt_index=list(range(start, start + len(part))),
                                    seed=seed)
            for i in range(len(batch)):
                texts[int(batch.prompt_index[i])].append(
                    tokenizer.decode(batch.response(i), skip_special_tokens=True))
    finally:
        engine.shutdown()
    samples, owner = [], []
    for k, rec in enumerate(records):
        for text in texts[k]:
            samples.append(RewardInput(rec.data_source, text, rec.ground_truth, rec.extra_info, rec.uid))
            owner.append(k)
    refs = [response_text(rec.response) if pp.add_reference else None for rec in records]
    ref_index = [k for k, ref in enumerate(refs) if isinstance(ref, str)]
    samples += [RewardInput(records[k].data_source, refs[k], records[k].ground_truth, records[k].extra_info,
                            records[k].uid) for k in ref_index]
    scores, _, _ = compute_rewards(reward_fn, samples, r.timeout_s, r.num_workers, r.reward_kwargs)
    per_prompt: list[list[tuple[str, float]]] = [[] for _ in records]
    for j, k in enumerate(owner):
        per_prompt[k].append((samples[j].solution_str, scores[j]))
    ref_score = dict(zip(ref_index, scores[len(owner):]))
    rows, with_best = [], 0
    d = cfg.data
    for k, rec in enumerate(records):
        pairs, info = pairs_for_prompt(per_prompt[k], refs[k] if k in ref_score else None, ref_score.get(k),
                                       pp.max_pairs_per_prompt)
        sampled_best = max((s for _, s in per_prompt[k]), default=None)
        # a prompt "has a best sample" when one of the policy's own samples reaches the best candidate's score
        if pairs and sampled_best is not None and sampled_best >= pairs[0][2]:
            with_best += 1
        counts = Counter(t for t, _ in per_prompt[k])
        for chosen, rejected, cs, rs in pairs:
            rows.append({d.data_source_key: rec.data_source, d.prompt_key: rec.prompt, cfg.rm.chosen_key: chosen,
                         cfg.rm.rejected_key: rejected, d.ground_truth_key: rec.ground_truth,
                         d.extra_info_key: {"uid": rec.uid, "chosen_score": cs, "rejected_score": rs,
                                            "chosen_count": counts[chosen], "rejected_count": counts[rejected],
                                            "samples": len(per_prompt[k])}})
    summary = {"prompts": len(records), "samples": len(owner),
               "sample_score_mean": sum(scores[:len(owner)]) / max(1, len(owner)),
               "prompts_paired": len({row[d.extra_info_key]["uid"] for row in rows}),
               "prompts_with_best_sample": with_best, "pairs": len(rows)}
    return rows, summary


def write_policy_pairs(cfg, model_path: str) -> dict[str, Path]:
    """Build and write the missing policy-pair files (rank 0); returns {"train": path, "val": path or absent}."""
    from megarl.data import write_dataset

    paths = policy_pair_paths(cfg)
    out = {}
    for split, path in paths.items():
        if split == "val" and not cfg.data.val_files:
            continue
        out[split] = path
        if path.exists():
            continue
        rows, s = build_policy_pairs(cfg, model_path, split)
        if not rows:
            raise ValueError(f"rm.policy_pairs: the {split} prompts gave no pair (every prompt's candidates scored "
                             f"the same); raise rm.policy_pairs.n or set rm.policy_pairs.add_reference=true")
        write_dataset(rows, str(path))
        log.info("rm: %d policy pairs from %d %s prompts (%d samples of %s, mean rule score %.3f; %d prompts paired, "
                 "%d with a best-scored sample) -> %s", s["pairs"], s["prompts"], split, s["samples"], model_path,
                 s["sample_score_mean"], s["prompts_paired"], s["prompts_with_best_sample"], path)
    return out
