"""A replica's rollout reaches every rank whole: broadcast_rollout over two real ranks (gloo) gives rank 1 a batch
equal to rank 0's, field by field (the devices it travels through are checked in tests/unit/test_nccl_device_tensors)."""
import torch

from megarl.launch_local import run_ranks


def round_trip() -> dict:
    import torch.distributed as dist

    from megarl.rollout.replicas import broadcast_rollout
    from tests.unit.test_nccl_device_tensors import _rollout

    got = broadcast_rollout(_rollout() if dist.get_rank() == 0 else None, src=0, device=torch.device("cpu"))
    return {k: getattr(got, k) for k in ("prompt_ids", "response_ids", "response_lengths", "rollout_logprobs",
                                         "finish_reasons", "truncated", "prompt_index", "prompt_truncated",
                                         "weight_version", "pad_token_id", "loss_mask", "tool_rewards",
                                         "routed_experts", "metrics")}


def test_broadcast_rollout_gives_every_rank_the_same_batch():
    from tests.unit.test_nccl_device_tensors import _rollout

    want = _rollout()
    sent, received = run_ranks(f"{__name__}:round_trip", 2, timeout=300)
    for key, value in received.items():
        expected = getattr(want, key)
        if isinstance(expected, torch.Tensor):
            assert value.dtype == expected.dtype and torch.equal(value, expected), key
        else:
            assert value == expected, key
    assert sent["response_ids"] is not None
