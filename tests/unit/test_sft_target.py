"""sft.target_loss: the SFT warm start stops once the mean loss of its last target_loss_window steps reaches the target
(megarl.sft.reached_target), the step count staying the cap."""
import pytest

from megarl.config.schema import SFTConfig
from megarl.sft import reached_target


def test_the_mean_of_the_last_window_steps_decides():
    losses = [1.2, 1.0, 0.7, 0.5, 0.4]
    assert not reached_target(losses, 0.5, 3)  # (0.7 + 0.5 + 0.4) / 3 = 0.533
    assert reached_target(losses, 0.55, 3)
    assert reached_target(losses[:4], 0.5, 1)  # one step at 0.5 reaches 0.5: "at or below"
    assert not reached_target(losses[:3], 0.5, 1)


def test_no_decision_before_a_full_window_or_without_a_target():
    assert not reached_target([0.1, 0.1], 0.5, 3)
    assert not reached_target([0.1] * 50, None, 3)


def test_the_settings_refuse_nonsense():
    assert SFTConfig().target_loss is None
    with pytest.raises(ValueError, match="target_loss"):
        SFTConfig(target_loss=0)
    with pytest.raises(ValueError, match="target_loss_window"):
        SFTConfig(target_loss=0.5, target_loss_window=0)
