"""Tool-output tokens of a multi-turn response carry mask 0 in every consumer of the train batch.

Sample 0's response is [m m t t m m] (m: sampled by the model, t: a tool turn's tokens), sample 1's is [m m m].
Each consumer is computed on the train batch with garbage on the tool positions (huge logprobs, values, entropies) and
compared with hand-derived values, or with the same consumer on the reference batch where the tool tokens were cut
out (a single-turn batch of the model's tokens only: what the consumers must see).
"""
import math

import pytest
import torch

from megarl import algo
from megarl.batching import build_train_batch
from megarl.rollout.replicas import combine
from megarl.types import RolloutBatch

def _rollout(with_tools: bool) -> RolloutBatch:
    if with_tools:
        resp = [[10, 11, 20, 21, 12, 13], [10, 12, 13]]
        mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
        lps = [[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4], [-0.5, -0.6, -0.7]]
    else:
        resp = [[10, 11, 12, 13], [10, 12, 13]]
        mask = None
        lps = [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7]]
    width = max(len(r) for r in resp)
    ids = torch.zeros(2, width, dtype=torch.long)
    lp = torch.zeros(2, width)
    for i, (r, l) in enumerate(zip(resp, lps)):
        ids[i, :len(r)] = torch.tensor(r)
        lp[i, :len(l)] = torch.tensor(l)
    return RolloutBatch(prompt_ids=[[5, 6], [5, 6]], response_ids=ids, response_lengths=torch.tensor([len(r) for r in resp]),
                        rollout_logprobs=lp, finish_reasons=["stop", "stop"], truncated=torch.tensor([False, False]),
                        prompt_index=torch.tensor([0, 0]), prompt_truncated=torch.tensor([False, False]),
                        loss_mask=mask, tool_rewards=torch.tensor([0.25, 0.0]) if with_tools else None)


@pytest.fixture()
def batches():
    scores = torch.tensor([1.0, 0.0])
    return build_train_batch(_rollout(True), scores, pad_token_id=0), build_train_batch(_rollout(False), scores, 0)


def _model_cols(tb):
    """Per sample, the positions of the tool batch holding the model's tokens, in order (row 0 skips the tools)."""
    return [[1, 2, 5, 6], [1, 2, 3]]


def _on_model(x_tool, cols):
    return [x_tool[i, c].tolist() for i, c in enumerate(cols)]


def _ref_values(ref, values):
    """Spread per-sample value lists onto the reference batch's valid positions."""
    out = torch.zeros(ref["response_mask"].shape)
    for i, v in enumerate(values):
        pos = ref["response_mask"][i].nonzero().flatten()
        out[i, pos] = torch.tensor(v)
    return out


def _tool_tensor(tb, values, garbage):
    """A [N, T] tensor of the tool batch: per-sample `values` on the model's positions, `garbage` everywhere else."""
    out = torch.full(tb["response_mask"].shape, garbage)
    for i, (c, v) in enumerate(zip(_model_cols(tb), values)):
        out[i, c] = torch.tensor(v)
    return out


def test_train_batch_masks_tool_tokens(batches):
    tb, ref = batches
    # hand-derived: token at column c is scored at c - 1; prompt is 2 tokens; tool tokens are columns 4, 5
    assert tb["response_mask"].tolist() == [[False, True, True, False, False, True, True],
                                            [False, True, True, True, False, False, False]]
    assert tb["rollout_log_probs"][0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert tb["token_level_scores"][0].tolist() == [0, 0, 0, 0, 0, 0, 1.0]  # on the last model token
    assert tb["input_ids"][0].tolist() == [5, 6, 10, 11, 20, 21, 12, 13]
    assert _on_model(tb["rollout_log_probs"], _model_cols(tb)) == [
        pytest.approx(x) for x in [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7]]]


def test_advantages_ignore_tool_tokens(batches):
    tb, ref = batches
    adv, _ = algo.grpo_advantage(token_level_rewards=tb["token_level_scores"], response_mask=tb["response_mask"],
                                 index=tb["prompt_index"])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # scores [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    assert adv[0].tolist() == pytest.approx([0, a, a, 0, 0, a, a], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([0, -a, -a, -a, 0, 0, 0], abs=1e-6)
    # GAE: the critic's values on tool positions are garbage and must not enter any bootstrap
    values = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7]]
    kw = dict(gamma=0.9, lam=0.8, whiten=False)
    adv, ret = algo.gae_advantage(token_level_rewards=tb["token_level_scores"], response_mask=tb["response_mask"],
                                  values=_tool_tensor(tb, values, 100.0), **kw)
    # hand-derived for sample 0 (reward 1 on its last model token; next valid token skips the tool turn)
    a6 = 1 - 0.4
    a5 = (0.9 * 0.4 - 0.3) + 0.72 * a6
    a2 = (0.9 * 0.3 - 0.2) + 0.72 * a5
    a1 = (0.9 * 0.2 - 0.1) + 0.72 * a2
    assert adv[0].tolist() == pytest.approx([0, a1, a2, 0, 0, a5, a6], abs=1e-6)
    ref_adv, ref_ret = algo.gae_advantage(token_level_rewards=ref["token_level_scores"],
                                          response_mask=ref["response_mask"], values=_ref_values(ref, values), **kw)
    assert _on_model(adv, _model_cols(tb)) == [pytest.approx(r[m].tolist(), abs=1e-6)
                                               for r, m in zip(ref_adv, ref["response_mask"])]
    assert _on_model(ret, _model_cols(tb)) == [pytest.approx(r[m].tolist(), abs=1e-6)
                                               for r, m in zip(ref_ret, ref["response_mask"])]
    assert adv[0, 3:5].tolist() == [0, 0] and ret[0, 3:5].tolist() == [0, 0]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_losses_kl_entropy_value_ignore_tool_tokens(batches, agg):
    tb, ref = batches
    model = [[-0.3, -0.1, -0.2, -0.6], [-0.4, -0.9, -0.2]]
    old = [[-0.2, -0.2, -0.3, -0.5], [-0.5, -0.6, -0.7]]
    adv = [[0.5, 0.5, -1.0, 2.0], [-0.3, 0.1, 0.2]]
    ent = [[1.0, 2.0, 3.0, 4.0], [0.5, 0.25, 0.125]]

    def both(fn):
        on_tool = fn(lambda v, g: _tool_tensor(tb, v, g), tb["response_mask"])
        on_ref = fn(lambda v, g: _ref_values(ref, v), ref["response_mask"])
        return on_tool, on_ref

    pg = both(lambda t, m: algo.ppo_clip_loss(t(old, 9.0), t(model, 50.0), t(adv, 7.0), m, loss_agg_mode=agg)[0])
    assert pg[0].item() == pytest.approx(pg[1].item(), abs=1e-6)
    kl = both(lambda t, m: algo.kl_loss(t(model, 50.0), t(old, -50.0), m, "low_var_kl", agg)[0])
    assert kl[0].item() == pytest.approx(kl[1].item(), abs=1e-6)
    en = both(lambda t, m: algo.agg_loss(t(ent, 1e3), m, agg))
    assert en[0].item() == pytest.approx(en[1].item(), abs=1e-6)
    vl = both(lambda t, m: algo.value_loss(t(model, 1e3), t(adv, -1e3), t(old, 5.0), m, 0.2, agg)[0])
    assert vl[0].item() == pytest.approx(vl[1].item(), abs=1e-6)
    if agg == "token-mean":  # hand-derived: entropy token mean over the 7 model tokens only
        assert en[0].item() == pytest.approx(sum(sum(e) for e in ent) / 7)


def test_rollout_correction_and_overlong_ignore_tool_tokens(batches):
    tb, ref = batches
    old = [[-0.2, -0.2, -0.3, -0.5], [-0.5, -0.6, -0.7]]
    rollout = _tool_tensor(tb, [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7]], 0.0)
    for level in ("token", "sequence"):
        w, m = algo.rollout_is_weights(_tool_tensor(tb, old, 40.0), rollout, tb["response_mask"], level=level)
        w_ref, m_ref = algo.rollout_is_weights(_ref_values(ref, old), _ref_values(ref, [[-0.1, -0.2, -0.3, -0.4],
                                                                                        [-0.5, -0.6, -0.7]]),
                                               ref["response_mask"], level=level)
        assert _on_model(w, _model_cols(tb)) == [pytest.approx(r[k].tolist(), abs=1e-6)
                                                 for r, k in zip(w_ref, ref["response_mask"])]
    for level in ("token", "sequence", "geometric"):
        # garbage ratios on the tool tokens must not reject the sample's model tokens (sequence/geometric levels)
        keep, _ = algo.rollout_rejection_mask(_tool_tensor(tb, old, 40.0), rollout, tb["response_mask"], level=level,
                                              threshold=1.5)
        keep_ref, _ = algo.rollout_rejection_mask(_ref_values(ref, old), _ref_values(
            ref, [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7]]), ref["response_mask"], level=level, threshold=1.5)
        assert _on_model(keep, _model_cols(tb)) == [r[k].tolist() for r, k in zip(keep_ref, ref["response_mask"])]
        assert not keep[0, 3:5].any()  # a tool token is never kept
    # DAPO overlong shaping counts the model's tokens: 4 and 3 (not the 6 of sample 0's whole response)
    rollout_batch = _rollout(True)
    assert rollout_batch.model_token_counts().tolist() == [4, 3]
    penalty, _ = algo.overlong_reward_penalty(rollout_batch.model_token_counts(), 6, 3, 1.0)
    assert penalty.tolist() == pytest.approx([-1 / 3, 0.0])  # 4 tokens: 1 into the 3-token buffer before 6


def test_mask_and_tool_rewards_survive_select_concat_combine():
    a, b = _rollout(True), _rollout(False)
    both = combine([a, b])
    assert both.loss_mask.shape == (4, 6)
    assert both.loss_mask[:2].tolist() == a.loss_mask.tolist()
    assert both.loss_mask[2:, :4].tolist() == b.response_mask().tolist()  # a single-turn share: all its tokens
    assert not both.loss_mask[2:, 4:].any()
    assert both.tool_rewards.tolist() == [0.25, 0.0, 0.0, 0.0]
    picked = both.select([1, 0])
    assert picked.loss_mask.tolist() == [a.loss_mask[1].tolist(), a.loss_mask[0].tolist()]
    assert picked.tool_rewards.tolist() == [0.0, 0.25]
