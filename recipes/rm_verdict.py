"""reward.combine_fn of recipes/ppo_rm_tiny_cpu.yaml: the reward model used as a verifier, 1 where its score is above
THRESHOLD, else 0.

Why not its raw score: GRPO divides each group's advantages by the group's standard deviation, so in a group where
every sample is wrong (most groups early on, when 20% of the policy's samples are right) the reward model's order
among wrong answers becomes advantages of full size, where the rule gives no gradient; an exact 0/1 reward gives such
groups none either. Why 2.5: the reward model scores the SFT policy's right answers 5.3 and its wrong ones -4.0 on
average; at 0 it accepted 30% of the first step's samples where 20% were right, and those accepted mistakes were
learned too. Measured (docs/results.md, "RL on a learned reward", seed 1, 50 steps): raw score 0.266 -> 0.227, threshold 0
0.266 -> 0.270, threshold 2.5 0.266 -> 0.320."""
import torch

THRESHOLD = 2.5


def rm_accepts(components: dict) -> torch.Tensor:
    """{"rm": [N] reward-model scores} -> [N] floats, 1.0 where the score is above THRESHOLD."""
    return (components["rm"] > THRESHOLD).float()
