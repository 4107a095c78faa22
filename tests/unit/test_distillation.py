"""On-policy distillation: the per-token reverse-KL advantage against hand-derived values, and its config checks."""
import math

import pytest
import torch

from megarl.algo import reverse_kl_advantage
from megarl.config import ConfigError, load_unchecked
from megarl.validate import load_config

TINY = {"model": {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 2}}}


def test_reverse_kl_advantage_by_hand():
    # student p = .5, .25 (row 0), .8 (row 1, one token); teacher p = .25, .5, .8
    # advantage = -coef * (ln p_s - ln p_t): -2 ln 2, +2 ln 2 (coef 2), 0; reverse KL mean = (ln 2 - ln 2 + 0) / 3
    student = torch.log(torch.tensor([[0.5, 0.25], [0.8, 1.0]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[0.25, 0.5], [0.8, 0.1]], dtype=torch.float64))
    mask = torch.tensor([[True, True], [True, False]])
    adv, m = reverse_kl_advantage(student, teacher, mask, kl_coef=2.0)
    assert adv.flatten().tolist() == pytest.approx([-2 * math.log(2), 2 * math.log(2), 0.0, 0.0])
    assert m["reverse_kl"].item() == pytest.approx(0.0)
    assert m["teacher_log_prob_mean"].item() == pytest.approx((math.log(0.25) + math.log(0.5) + math.log(0.8)) / 3)
    # a student sure of a token the teacher finds unlikely is pushed away from it (uncentred: -3)
    adv, m = reverse_kl_advantage(torch.tensor([[-0.1]]), torch.tensor([[-3.1]]), torch.tensor([[True]]),
                                  center=False)
    assert adv.item() == pytest.approx(-3.0) and m["reverse_kl"].item() == pytest.approx(3.0)
    # centred: per-token KL 3 and 1 (mean 2) -> advantages -(3 - 2) = -1 and -(1 - 2) = +1
    adv, m = reverse_kl_advantage(torch.tensor([[-0.1, -1.0]]), torch.tensor([[-3.1, -2.0]]),
                                  torch.tensor([[True, True]]))
    assert adv.flatten().tolist() == pytest.approx([-1.0, 1.0]) and m["reverse_kl"].item() == pytest.approx(2.0)


def test_distillation_needs_a_teacher():
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", "distillation.enable=true"])
    assert "set distillation.teacher.path" in str(err.value)
    cfg = load_unchecked(data=TINY, overrides=["rollout.n=4", "distillation.enable=true",
                                               "distillation.teacher.path=teacher_dir"])
    from megarl.steps import old_log_probs_from_update

    assert not old_log_probs_from_update(cfg, actor_updates=True)  # the student's logprobs are needed first
