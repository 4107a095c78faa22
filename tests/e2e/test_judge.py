"""The generative judge (reward.judge) on a vLLM engine with a tiny judge model built to answer one fixed token: its
verdicts are known, so the scores, the parse-failure path, the timeout path and the sleep/wake around each call can be
checked. Plus the verdict parsers on their own (pure)."""
import pytest
import torch

from megarl.reward.judge import make_parser, parse_verdicts, question_text


def test_parsers_and_failure_rule():
    number, regex = make_parser("number"), make_parser("regex", r"score: (\d+)")
    assert number("the grade is 7 of 10") == 7.0 and number("none") is None and number("-2.5!") == -2.5
    assert regex("score: 9") == 9.0 and regex("9") is None
    assert make_parser("regex", r"\d+")("x 42") == 42.0  # no group: the whole match

    def boom(text):
        raise RuntimeError("parser bug")

    scores, counts = parse_verdicts(["8", "no idea", "3", "7"], [True, True, True, False], number, 0.1, -1.0)
    assert scores == pytest.approx([0.8, -1.0, 0.3, -1.0]) and counts == {"parse_failures": 1, "timeouts": 1}
    scores, counts = parse_verdicts(["8"], [True], boom, 1.0, 0.0)  # a raising parser is a failed verdict
    assert scores == [0.0] and counts["parse_failures"] == 1
    scores, counts = parse_verdicts(["x"], [True], lambda t: float("nan"), 1.0, 0.5)
    assert scores == [0.5] and counts["parse_failures"] == 1
    assert question_text([{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}]) == "q?"


def fixed_answer_model(out, answer: str):
    """A Llama whose greedy output is always `answer` (one token of the synthetic task's tokenizer): the residual
    stream's dimension 0 is 1 for every token and no layer writes to it; the final norm keeps only that dimension and
    the LM head maps it to `answer` alone."""
    import transformers

    from megarl.data import arithmetic_tokenizer

    tok = arithmetic_tokenizer(str(out), max_operand=20)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=False,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.convert_tokens_to_ids(answer), 0] = 10.0
    model.save_pretrained(str(out))
    return out


class _RecordingEngine:
    """Stands in for the judge's EngineProcess: records sleep/wake and refuses to generate while asleep (a vLLM engine
    asleep at level 1 has no KV cache and its weights are in host memory)."""

    instances: list = []
    verdict_id = 0  # the token every verdict is made of

    def __init__(self, config, model_path, seed=0, prompt_overflow="error", name=""):
        self.config, self.events, self.asleep, self.fail = config, [], False, False
        _RecordingEngine.instances.append(self)

    def sleep(self, level: int = 2) -> None:
        self.events.append(f"sleep({level})")
        self.asleep = True

    def wake_up(self, tags=None) -> None:
        self.events.append("wake_up")
        self.asleep = False

    def start_generate(self, prompts, n=1, greedy=True, seed=None):
        from megarl.rollout.protocol import Deferred

        assert not self.asleep, "the judge generated while its engine was asleep"
        self.events.append("generate")
        if self.fail:
            raise RuntimeError("engine failure")
        return Deferred.ready(_Verdicts(len(prompts), [self.verdict_id]))

    def abort(self) -> None:
        self.events.append("abort")

    def shutdown(self, timeout_s: float = 30) -> None:
        self.events.append("shutdown")


class _Verdicts:
    def __init__(self, n: int, ids: list):
        self.finish_reasons, self._ids = ["stop"] * n, ids

    def __len__(self) -> int:
        return len(self.finish_reasons)

    def response(self, i: int) -> list:
        return list(self._ids)


def test_colocated_judge_engine_sleeps_outside_its_calls_so_the_update_phase_has_its_memory(tmp_path, monkeypatch):
    """CPU vLLM has no sleep mode, so this checks the protocol on a recording engine: asleep (level 1: KV cache
    dropped, weights offloaded) from its start, awake only inside grade(), asleep again after a call that failed; a
    separate judge never sleeps. The trainer calls the judge only while scoring a step (StepReward.total), so its
    engine is asleep during the update phase. The slow test below runs the same on a real vLLM engine."""
    import megarl.rollout.hosting.process as process
    from megarl.config import MegarlConfig
    from megarl.data import arithmetic_tokenizer
    from megarl.reward.compute import RewardInput
    from megarl.reward.judge import Judge

    tok = arithmetic_tokenizer(str(tmp_path / "judge"), max_operand=20)
    monkeypatch.setattr(process, "EngineProcess", _RecordingEngine)
    _RecordingEngine.verdict_id = tok.convert_tokens_to_ids("7")

    def judge_for(placement):
        cfg = MegarlConfig.model_validate({"reward": {"judge": {
            "enable": True, "path": str(tmp_path / "judge"), "parser": "number", "placement": placement}}})
        return Judge(cfg)

    judge = judge_for("colocated")
    engine = _RecordingEngine.instances[-1]
    assert engine.config.enable_sleep_mode and engine.events == ["sleep(1)"] and engine.asleep
    samples = [RewardInput("arithmetic", "#### 3", "3", None)] * 2
    for call in range(2):  # step after step: awake only while grading
        scores, _, _ = judge.grade(["1 + 2 ?"] * 2, samples)
        assert scores == [7.0, 7.0] and engine.asleep
    assert engine.events == ["sleep(1)"] + ["wake_up", "generate", "sleep(1)"] * 2
    engine.fail = True
    with pytest.raises(RuntimeError, match="engine failure"):
        judge.grade(["1 + 2 ?"], samples[:1])
    assert engine.asleep and engine.events[-1] == "sleep(1)"  # an error does not leave it holding memory
    judge.close()

    separate = judge_for("separate")
    engine = _RecordingEngine.instances[-1]
    separate.grade(["1 + 2 ?"], samples[:1])
    assert not engine.config.enable_sleep_mode and engine.events == ["generate"]


@pytest.mark.slow
def test_judge_scores_fails_times_out_and_sleeps_between_calls(tmp_path):
    from megarl.config import MegarlConfig
    from megarl.reward.compute import RewardInput
    from megarl.reward.judge import Judge

    path = fixed_answer_model(tmp_path / "judge", "7")
    cfg = MegarlConfig.model_validate({"reward": {"judge": {
        "enable": True, "path": str(path), "parser": "number", "scale": 0.1, "failure_score": -1.0,
        "max_new_tokens": 48, "context_length": 128, "prompt_template": "What is {question} {response} {ground_truth}",
        "timeout_s": 120}}})
    judge = Judge(cfg)
    try:
        assert judge.engine.events == ["sleep(1)"]  # asleep (weights to host memory) until the first call
        questions = ["13 + 8 ?", "1 + 1 ?", "3 + 4 ?", "0 + 0 ?"]
        samples = [RewardInput("arithmetic", f"#### {k}", str(k), None) for k in range(4)]
        scores, metrics, texts = judge.grade(questions, samples)
        assert all(t.split()[:3] == ["7", "7", "7"] for t in texts), texts
        assert scores == pytest.approx([0.7] * 4)
        assert metrics == {"reward/judge_parse_failures": 0.0, "reward/judge_timeouts": 0.0}
        assert judge.engine.events == ["sleep(1)", "wake_up", "sleep(1)"]  # awake only while it judged

        judge.parse = make_parser("regex", r"score: (\d+)")  # a verdict format this judge never writes
        scores, metrics, _ = judge.grade(questions, samples)
        assert scores == [-1.0] * 4 and metrics["reward/judge_parse_failures"] == 4.0

        judge.parse = make_parser("number")
        # 16 verdicts of 48 tokens are 48 decode steps one after the other, each a vLLM scheduler step and a forward
        # (well over 100 us on any CPU), after the request crossed into the engine process: 1 ms is too little on every
        # machine (0.2 s was not on a fast one)
        judge.cfg = judge.cfg.model_copy(update={"timeout_s": 0.001})
        scores, metrics, _ = judge.grade(questions * 4, samples * 4)
        assert metrics["reward/judge_timeouts"] >= 1, metrics
        assert scores.count(-1.0) == metrics["reward/judge_timeouts"]
        assert all(s in (-1.0, pytest.approx(0.7)) for s in scores)
        assert judge.engine.events[-1] == "sleep(1)"
    finally:
        judge.close()
