"""The engine process's replies: small tensors travel inside the message (no shared-memory segment and file to pass
per tensor), large ones in shared memory; both arrive equal, with their dtype and shape."""
import pickle

import pytest
import torch

from megarl.rollout.hosting.process import _BY_VALUE_BYTES, _ReplyPickler


@pytest.mark.parametrize("tensor", [
    torch.arange(12).reshape(3, 4),
    torch.randn(5, 3).to(torch.bfloat16),
    torch.zeros(0, 7, dtype=torch.float32),
    torch.arange(20)[::3],  # a strided view
    torch.tensor([True, False]),
], ids=["long", "bf16", "empty", "view", "bool"])
def test_small_tensors_go_by_value(tensor):
    data = _ReplyPickler.dumps((7, "ok", {"t": tensor}))
    assert tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() in bytes(data)  # the values themselves
    call_id, status, value = pickle.loads(data)
    got = value["t"]
    assert (call_id, status) == (7, "ok") and got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_large_tensors_go_through_shared_memory():
    big = torch.ones(_BY_VALUE_BYTES // 4 + 1)
    data = _ReplyPickler.dumps(big)
    assert len(data) < 10_000  # a handle, not the bytes
    assert torch.equal(pickle.loads(data), big)
