"""reward.combine_fn of recipes/ppo_rm_tiny_cpu.yaml: the reward model used as a verifier, 1 where its score is above
THRESHOLD, else 0.

Why not its raw score: GRPO divides each group's advantages by the group's standard deviation, so in a group where
every sample is wrong the reward model's order among wrong answers becomes advantages of full size, where the rule
gives no gradient; an exact 0/1 reward gives such groups none either (HISTORY.md, "RL on a learned reward": the raw
score made the greedy answer worse while the reward model's own measure rose).

Why 0: recipes/rm_tiny_cpu.yaml trains the reward model with reward centering (rm.center_rewards_coefficient), so a
question's right answers score above 0 and its wrong ones below, whatever the question. A Bradley-Terry model trained
without it orders the answers of one question but puts each question's scores around an offset of its own: at the
threshold that model needed (2.5) it rejected 13-15% of the right samples in RL (all of them for 80 of 440 questions)
and accepted 3% of the wrong ones; the centred one at 0 rejected at most 0.1% and accepted 0.5-6%."""
import torch

THRESHOLD = 0.0


def rm_accepts(components: dict) -> torch.Tensor:
    """{"rm": [N] reward-model scores} -> [N] floats, 1.0 where the score is above THRESHOLD."""
    return (components["rm"] > THRESHOLD).float()
