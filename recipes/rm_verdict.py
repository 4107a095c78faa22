"""reward.combine_fn of recipes/ppo_rm_tiny_cpu.yaml: the reward model used as a verifier, 1 where its score is
positive, else 0.

Why not its raw score: GRPO divides each group's advantages by the group's standard deviation, so in a group where
every sample is wrong (most groups early on, when 20% of the policy's samples are right) the reward model's order
among wrong answers becomes advantages of full size, where the rule gives no gradient; an exact 0/1 reward gives such
groups none either. Measured (README, "Learned rewards"): it stopped the decline of the raw score's run (0.266 -> 0.227
at step 50) but the policy did not improve (0.266 -> 0.270)."""
import torch


def rm_accepts(components: dict) -> torch.Tensor:
    """{"rm": [N] reward-model scores} -> [N] floats, 1.0 where the score is above 0."""
    return (components["rm"] > 0).float()
