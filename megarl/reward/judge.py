"""A generative judge (reward.judge): an LLM in a vLLM engine process grades each response; its verdict is parsed
into a score.

    reward:
      judge:
        enable: true
        path: Qwen/Qwen2.5-7B-Instruct            # any causal LM megarl's engines serve
        prompt_template: "Question: {question}\\nAnswer: {response}\\nReference: {ground_truth}\\nGrade 0-10:"
        parser: number                            # number | regex (parser_regex) | function (parser_fn)
        scale: 0.1                                # a 0-10 grade -> 0-1
        failure_score: 0.0

One engine, owned by global rank 0 (which scores the step's rewards), started with the trainer. Each call renders
every sample's prompt ({question}: the prompt's last user message, or its text; {response}: the decoded response;
{ground_truth}) with the judge's chat template (plain text when it has none; the start is cut beyond
context_length - max_new_tokens) and generates all verdicts in one batch (greedy at temperature 0).

Placement. colocated: the engine sleeps between calls at vLLM's sleep level 1 (KV cache dropped, weights moved to host
memory), so its accelerator memory is free while the trainer computes, and wakes for the next call. separate: it stays
awake (on CPU machines: a process with its own threads; on GPU: its own device, CUDA_VISIBLE_DEVICES of the trainer).

Failures are scored, never raised: a verdict the parser cannot read (the parser returns None, raises, or finds no
number) and a verdict not finished within timeout_s (its request is aborted) both score `failure_score`; they are
counted per step as reward/judge_parse_failures and reward/judge_timeouts. A dead engine still stops the run.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("megarl")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def make_parser(kind: str, regex: Optional[str] = None, fn: Optional[Callable] = None) -> Callable[[str], Optional[float]]:
    """verdict text -> number or None. number: the first number in it; regex: group 1 of the first match (else the
    whole match) as a number; function: fn(text) (None: cannot tell)."""
    if kind == "number":
        return lambda text: float(m.group()) if (m := NUMBER.search(text)) else None
    if kind == "regex":
        pattern = re.compile(regex)

        def parse(text: str) -> Optional[float]:
            m = pattern.search(text)
            if m is None:
                return None
            try:
                return float(m.group(1) if m.groups() else m.group())
            except (TypeError, ValueError):
                return None
        return parse
    if kind == "function":
        return fn
    raise ValueError(f"reward.judge.parser={kind!r}: choose number, regex or function")


def parse_verdicts(texts: Sequence[str], finished: Sequence[bool], parse: Callable, scale: float,
                   failure_score: float) -> tuple[list[float], dict]:
    """Scores from verdicts (finished[i] False: it timed out). Returns (scores, {"parse_failures", "timeouts"})."""
    import math

    scores, failures, timeouts = [], 0, 0
    for text, done in zip(texts, finished):
        if not done:
            timeouts += 1
            scores.append(failure_score)
            continue
        try:
            value = parse(text)
            value = None if value is None else float(value)
        except Exception as exc:  # noqa: BLE001 - a user parser's bug is a failed verdict, counted, not a crash
            log.debug("judge: the parser raised %s on %r", exc, text[:200])
            value = None
        if value is None or not math.isfinite(value):
            failures += 1
            scores.append(failure_score)
        else:
            scores.append(value * scale)
    return scores, {"parse_failures": failures, "timeouts": timeouts}


def question_text(prompt: Any) -> str:
    """{question}: the last user message of chat prompts, the text of plain ones."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt[-1]["content"])


class Judge:
    """The judge engine and its tokenizer, prompt and parser (rank 0)."""

    def __init__(self, cfg, seed: int = 0):
        from transformers import AutoTokenizer

        from megarl.config.schema import RolloutConfig
        from megarl.reward.registry import load_reward_fn
        from megarl.rollout.hosting.process import EngineProcess

        self.cfg = j = cfg.reward.judge
        self.tokenizer = AutoTokenizer.from_pretrained(j.path, trust_remote_code=cfg.model.trust_remote_code)
        self.parse = make_parser(j.parser, j.parser_regex, load_reward_fn(j.parser_fn) if j.parser_fn else None)
        self.colocated = j.placement == "colocated"
        engine_cfg = RolloutConfig(
            prompt_length=j.context_length - j.max_new_tokens, response_length=j.max_new_tokens,
            max_model_len=j.context_length, n=1, temperature=j.temperature, do_sample=j.temperature > 0,
            kv_cache_memory_bytes=j.kv_cache_memory_bytes, gpu_memory_utilization=j.gpu_memory_utilization,
            enable_sleep_mode=self.colocated, free_cache_engine=True, calculate_log_probs=False,
            max_num_seqs=256, enable_prefix_caching=True)
        self.engine = EngineProcess(engine_cfg, j.path, seed=seed, prompt_overflow="left", name="megarl-judge")
        self.calls = 0
        if self.colocated:
            self.engine.sleep(level=1)

    def render(self, question: str, response: str, ground_truth: Any) -> list[int]:
        text = self.cfg.prompt_template.format(question=question, response=response, ground_truth=ground_truth)
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.tokenizer.encode(text)

    def grade(self, questions: Sequence[str], samples: Sequence) -> tuple[list[float], dict, list[str]]:
        """Scores [N] of samples (RewardInput) to `questions`, metrics, and the verdict texts."""
        j = self.cfg
        prompts = [self.render(q, s.solution_str, s.ground_truth) for q, s in zip(questions, samples)]
        if self.colocated:
            self.engine.wake_up()
        try:
            handle = self.engine.start_generate(prompts, n=1, greedy=j.temperature == 0,
                                                seed=None if j.temperature == 0 else self.calls)
            waiter = threading.Thread(target=handle.result, name="megarl-judge-wait", daemon=True)
            waiter.start()
            waiter.join(j.timeout_s)
            if waiter.is_alive():  # over time: what is still generating ends now, finish_reason "abort"
                self.engine.abort()
                waiter.join()
            batch = handle.result()
        finally:
            if self.colocated:
                self.engine.sleep(level=1)
        self.calls += 1
        texts = [self.tokenizer.decode(list(batch.response(i)), skip_special_tokens=True) for i in range(len(batch))]
        finished = [reason != "abort" for reason in batch.finish_reasons]
        scores, counts = parse_verdicts(texts, finished, self.parse, j.scale, j.failure_score)
        metrics = {"reward/judge_parse_failures": float(counts["parse_failures"]),
                   "reward/judge_timeouts": float(counts["timeouts"])}
        return scores, metrics, texts

    def close(self) -> None:
        self.engine.shutdown(timeout_s=5)
