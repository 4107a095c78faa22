"""reward.combine_fn of recipes/ppo_rm_tiny_cpu.yaml: the reward model used as a verifier, 1 where its score is
positive, else 0.

Why not its raw score: GRPO divides each group's advantages by the group's standard deviation, so in a group where
every sample is wrong (most groups early on, when the policy answers 20% of its samples right) the reward model's
arbitrary order among wrong answers becomes advantages of full size, and the policy is pushed between wrong answers.
An exact 0/1 reward gives such groups no gradient, as the rule does."""
import torch


def rm_accepts(components: dict) -> torch.Tensor:
    """{"rm": [N] reward-model scores} -> [N] floats, 1.0 where the score is above 0."""
    return (components["rm"] > 0).float()
