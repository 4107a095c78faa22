"""Reward-model pieces: the Bradley-Terry loss (hand-derived values), last-token pooling, pair encoding, the synthetic
preference pairs, and `megarl validate` on reward_model / judge / components settings."""
import math

import pytest
import torch

from megarl.config import ConfigError
from megarl.data.synthetic import make_arithmetic_preferences
from megarl.reward.model import bt_loss, encode_side, last_token_scores, pad_rows, same_tokenizer, score_length
from megarl.validate import load_config


def test_bt_loss_matches_hand_values():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1, 0, -2
    want = (math.log(1 + math.exp(-1)) + math.log(2) + math.log(1 + math.exp(2))) / 3
    loss, m = bt_loss(chosen, rejected)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["accuracy"].item() == pytest.approx(1 / 3)  # a tie is not a win
    assert m["margin"].item() == pytest.approx((1 + 0 - 2) / 3)
    # a global denominator (other micro-batches / DP ranks hold more pairs): the same sum, divided by it
    loss6, _ = bt_loss(chosen, rejected, torch.tensor(6.0))
    assert loss6.item() == pytest.approx(want / 2, rel=1e-6)


def test_bt_loss_gradient_pushes_chosen_up():
    chosen, rejected = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    bt_loss(chosen, rejected)[0].backward()
    # d/dc of -log sigmoid(c - r) / P at c = r: -(1 - 1/2) / 2
    assert torch.allclose(chosen.grad, torch.full((2,), -0.25)) and torch.allclose(rejected.grad, torch.full((2,), 0.25))


def test_bt_loss_centering_term_matches_trls_formula_by_hand():
    # TRL's RewardTrainer: loss = -logsigmoid(c - r).mean() + coef * ((c + r) ** 2).mean()
    chosen = torch.tensor([3.0, 1.0], requires_grad=True)
    rejected = torch.tensor([1.0, -2.0], requires_grad=True)
    coef = 0.1
    want = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-3))) / 2 + coef * (4.0 ** 2 + 1.0 ** 2) / 2
    loss, m = bt_loss(chosen, rejected, center_coef=coef)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["center"].item() == pytest.approx((4.0 - 1.0) / 2)
    loss.backward()
    # d/dc_i = [-sigmoid(-(c_i - r_i)) + 2 coef (c_i + r_i)] / P; d/dr_i = [sigmoid(-(c_i - r_i)) + 2 coef (c_i + r_i)] / P
    sig = [1 / (1 + math.exp(2)), 1 / (1 + math.exp(3))]
    assert chosen.grad.tolist() == pytest.approx([(-sig[0] + 0.8) / 2, (-sig[1] - 0.2) / 2], rel=1e-6)
    assert rejected.grad.tolist() == pytest.approx([(sig[0] + 0.8) / 2, (sig[1] - 0.2) / 2], rel=1e-6)
    # a pair already centred adds nothing: only the Bradley-Terry part is left
    plain, _ = bt_loss(torch.tensor([1.5]), torch.tensor([-1.5]))
    centred, _ = bt_loss(torch.tensor([1.5]), torch.tensor([-1.5]), center_coef=coef)
    assert centred.item() == pytest.approx(plain.item(), rel=1e-7)


def test_last_token_scores_reads_each_rows_last_real_token():
    values = torch.arange(12, dtype=torch.float32).view(3, 4, 1)
    assert last_token_scores(values, torch.tensor([4, 1, 2])).tolist() == [3.0, 4.0, 9.0]


def test_pad_rows():
    ids, lengths = pad_rows([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1]
    # HF pools the last token that is not pad_token_id: with EOS (2) as the pad token, the token before a final EOS
    _, lengths = pad_rows([[5, 6, 2], [8, 2, 2], [2]], pad_id=2, score_pad_id=2)
    assert lengths.tolist() == [2, 1, 1]
    assert score_length([5, 2], pad_token_id=0) == 2 and score_length([5, 2], pad_token_id=None) == 2


@pytest.fixture(scope="module")
def arithmetic_tok(tmp_path_factory):
    from megarl.data import arithmetic_tokenizer

    return arithmetic_tokenizer(str(tmp_path_factory.mktemp("tok")), max_operand=20)


def test_encode_side_is_prompt_then_response_then_eos(arithmetic_tok):
    tok = arithmetic_tok
    prompt = [{"role": "user", "content": "What is 3 + 4 ?"}]
    ids, cut = encode_side(prompt, "#### 7", tok)
    want = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids == want + tok.convert_tokens_to_ids(["####", "7"]) + [tok.eos_token_id] and not cut
    short, cut = encode_side(prompt, "#### 7", tok, max_length=4)  # the start of the prompt goes, the end stays
    assert short == ids[-4:] and cut
    messages, _ = encode_side(prompt, [{"role": "assistant", "content": "#### 7"}], tok)
    assert messages == ids


def test_same_tokenizer(arithmetic_tok, tmp_path):
    from tests.helpers.tiny_models import make_tokenizer

    assert same_tokenizer(arithmetic_tok, arithmetic_tok)
    assert not same_tokenizer(arithmetic_tok, make_tokenizer(tmp_path / "bpe"))


def test_synthetic_pairs_prefer_the_correct_sum():
    rows = make_arithmetic_preferences(200, seed=3, max_operand=20)
    assert rows == make_arithmetic_preferences(200, seed=3, max_operand=20)
    near = 0
    for r in rows:
        a, b, wrong = r["extra_info"]["a"], r["extra_info"]["b"], r["extra_info"]["wrong"]
        assert r["chosen"] == f"#### {a + b}" and r["rejected"] == f"#### {wrong}"
        assert wrong != a + b and 0 <= wrong <= 40
        near += abs(wrong - a + -b) <= 3
    assert 60 <= near <= 160  # about half are near misses (plus the far ones that land near)
    worked = make_arithmetic_preferences(5, seed=1, answer_format="worked")
    for r in worked:
        a, b, w = r["extra_info"]["a"], r["extra_info"]["b"], r["extra_info"]["wrong"]
        assert r["rejected"] == f"{a} + {b} = {w} #### {w}"


def _problems(overrides, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config("recipes/grpo_tiny_cpu.yaml", overrides)
    return str(e.value)


def test_validate_accepts_reward_model_judge_and_components(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    # with their tokenizers: the reward model's scorer and the judge each load their own
    make_tiny_model("qwen2", tmp_path / "rm", head="value")
    make_tiny_model("qwen2", tmp_path / "judge")
    (tmp_path / "parse.py").write_text("def parse(text):\n    return 1.0\n")
    (tmp_path / "mix.py").write_text("def mix(c):\n    return c['rm']\n")
    cfg = load_config("recipes/grpo_tiny_cpu.yaml", [
        "reward.reward_model.enable=true", f"reward.reward_model.path={tmp_path}/rm",
        "reward.judge.enable=true", f"reward.judge.path={tmp_path}/judge", "reward.judge.parser=function",
        f"reward.judge.parser_fn={tmp_path}/parse.py:parse",
        "reward.components={acc: {fn: arithmetic}, fmt: {fn: format_regex, kwargs: {pattern: '####'}, weight: 0.5},"
        " rm: {type: reward_model, normalize: true, clip: [-2, 2]}, judge: {type: judge, weight: 0.1}}",
        f"reward.combine_fn={tmp_path}/mix.py:mix"])
    assert cfg.reward.components["rm"].clip == (-2.0, 2.0)


def test_validate_refuses_bad_learned_rewards(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    rm = make_tiny_model("qwen2", tmp_path / "rm", head="value", tokenizer=False)  # 4 attention heads, 4 layers
    text = _problems(["reward.reward_model.enable=true", "reward.judge.enable=true", "reward.judge.path=x",
                      "reward.components={a: {type: judge}, b: {type: rule, fn: no_such_rule}}"], tmp_path)
    assert "reward.judge.parser = None: a judge needs a parser" in text
    assert "reward.reward_model.path = None: an enabled reward model needs its directory" in text
    assert "reward.components.b.fn = 'no_such_rule'" in text
    assert "reward.reward_model.enable = True: with reward.components the reward_model only counts" in text
    text = _problems(["reward.reward_model.enable=true", f"reward.reward_model.path={rm}",
                      "parallelism.tensor_model_parallel_size=3", "trainer.n_gpus_per_node=3"], tmp_path)
    assert "reward.reward_model.path" in text and "tensor_model_parallel_size=3 does not divide num_attention_heads=4" \
        in text
    text = _problems(["reward.reward_model.path=somewhere"], tmp_path)
    assert "reward.reward_model.path = 'somewhere': read only by an enabled reward model" in text
    text = _problems(["reward.judge.enable=true", "reward.judge.path=x", "reward.judge.parser=regex"], tmp_path)
    assert "reward.judge.parser_regex = None: parser regex needs the pattern" in text
    text = _problems(["reward.judge.scale=0.1"], tmp_path)
    assert "reward.judge.scale = 0.1: read only by an enabled judge" in text
    text = _problems(["reward.reward_model.enable=true", "reward.reward_model.path=x", "reward.judge.enable=true",
                      "reward.judge.path=x", "reward.judge.parser=number"], tmp_path)
    assert "reward.components = {}: with both a reward model and a judge" in text
    text = _problems(["reward.components={r: {type: reward_model}}"], tmp_path)
    assert "reward.components.r.type = 'reward_model': a reward_model component needs reward.reward_model" in text


def test_combine_weights_normalize_clip_by_hand():
    from megarl.config.schema import RewardComponentConfig as C
    from megarl.reward.combine import combine, transform

    raw = {"a": torch.tensor([0.0, 1.0, 1.0, 0.0]), "b": torch.tensor([1.0, 3.0, 5.0, 7.0])}
    # b standardised: mean 4, population std sqrt(5) -> [-3, -1, 1, 3] / sqrt(5), then clipped to [-1, 1]
    b = torch.tensor([-3.0, -1.0, 1.0, 3.0]) / math.sqrt(5)
    assert torch.allclose(transform(raw["b"], True, None), b, atol=1e-5)
    settings = {"a": C(weight=2.0, clip=(0.0, 0.5)), "b": C(type="reward_model", weight=-1.0, normalize=True,
                                                           clip=(-1.0, 1.0))}
    want = 2.0 * torch.tensor([0.0, 0.5, 0.5, 0.0]) - b.clamp(-1, 1)
    assert torch.allclose(combine(raw, settings), want, atol=1e-5)
    # a user function gets the transformed components
    got = combine(raw, settings, combine_fn=lambda c: c["a"] * c["b"])
    assert torch.allclose(got, torch.tensor([0.0, 0.5, 0.5, 0.0]) * b.clamp(-1, 1), atol=1e-5)
    with pytest.raises(ValueError, match="reward.combine_fn returned"):
        combine(raw, settings, combine_fn=lambda c: torch.zeros(3))


def test_convert_verl_maps_the_reward_model_keys():
    from megarl.convert_verl import convert

    c = convert({"reward_model.enable": True, "reward_model.model.path": "/ckpt/rm",
                 "reward_model.micro_batch_size_per_gpu": 16, "reward_model.max_length": 2048})
    assert not c.refused, c.refused
    text = "\n".join(c.mapped)
    for key in ("reward.reward_model.enable", "reward.reward_model.path", "reward.reward_model.micro_batch_size_per_gpu",
                "reward.reward_model.max_length"):
        assert key in text, text
