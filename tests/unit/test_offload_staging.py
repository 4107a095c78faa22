"""The offloader's host staging area: one buffer at the exact (page-aligned) size of the states, reused by every
offload, grown when the states grow, freed by release(); the round trip through it is bitwise."""
import torch

from megarl.megatron.offload import ALIGN, StateOffloader


class _Chunk:
    """A model chunk as category_tensors reads one: its parameters (no megatron DDP buffers)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def parameters(self):
        return iter(self.tensors)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def test_one_staging_area_is_reused_grown_and_released():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g), torch.randn(3000, generator=g, dtype=torch.float64)
    chunk = _Chunk([a, b])
    want = [a.clone(), b.clone()]
    off = StateOffloader([chunk])
    first = off.offload()
    assert first["bytes"] == 4000 + 24000 and a.untyped_storage().nbytes() == 0 == b.untyped_storage().nbytes()
    assert off.staging_bytes() == 4096 + 24576  # each storage's slice starts on a page
    ptr = off._staging.buffer.data_ptr()
    off.onload()
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])
    off.offload()
    assert off._staging.buffer.data_ptr() == ptr and off.staging_bytes() == 4096 + 24576  # reused, not re-allocated
    off.onload()
    c = torch.randn(500, generator=g)  # states that appear later (Adam's moments at the optimizer's first step)
    chunk.tensors.append(c)
    want.append(c.clone())
    assert off.offload()["bytes"] == 4000 + 24000 + 2000
    assert off.staging_bytes() == _aligned(4000) + _aligned(24000) + _aligned(2000)
    off.release()  # onloads first, then frees the staging area
    assert off.staging_bytes() == 0 and not off.offloaded
    assert all(torch.equal(t, w) for t, w in zip(chunk.tensors, want))
