"""megarl's layer spec without Transformer Engine, and the precision policy.

- SDPAttention (megatron's core-attention contract through torch's scaled_dot_product_attention) equals attention
  written out by hand (scores, mask, softmax, weighted sum) for GQA, the marked causal mask, an explicit causal mask
  with right padding, and a padding mask that masks a whole query row.
- The local block spec puts SDPAttention and megarl's RMSNorm where megatron's spec has DotProductAttention and
  WrappedTorchNorm (which ignores params_dtype).
- apply_precision sets torch's TF32 flags and the CUDA libraries' override as asked.
"""
import math

import pytest
import torch

from megarl.megatron import precision


def _config(heads=4, groups=2, head_dim=8, dtype=torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, ffn_hidden_size=64, normalization="RMSNorm",
                             params_dtype=dtype, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                             bf16=dtype == torch.bfloat16)


def _reference(q, k, v, masked):
    """q [s, b, h, d], k/v [s, b, g, d], masked [b or 1, 1, s, s] True = masked -> [s, b, h * d], by hand."""
    s, b, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q.double(), k.double()) / math.sqrt(d)
    scores = scores.masked_fill(masked, torch.finfo(torch.float64).min)
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v.double())
    return out.reshape(s, b, h * d).float()


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    s, b = 7, 3
    return (torch.randn(s, b, 4, 8, generator=g), torch.randn(s, b, 2, 8, generator=g),
            torch.randn(s, b, 2, 8, generator=g))


def _attention(cfg):
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.megatron.layer_spec import SDPAttention

    return SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def test_sdpa_core_attention_with_gqa_and_the_marked_causal_mask_equals_attention_by_hand(qkv):
    from megarl.megatron.forward import causal_inputs

    q, k, v = qkv
    _, mask = causal_inputs(torch.ones(q.shape[1], q.shape[0], dtype=torch.long))
    out = _attention(_config())(q, k, v, mask)
    assert out.shape == (7, 3, 32)
    torch.testing.assert_close(out, _reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_sdpa_core_attention_applies_an_explicit_padding_mask_on_top_of_causal(qkv):
    q, k, v = qkv
    s, b = q.shape[:2]
    lengths = torch.tensor([7, 5, 3])
    pad = torch.arange(s)[None, :] >= lengths[:, None]  # [b, s] key is padding
    explicit = pad[:, None, None, :].expand(b, 1, s, s).clone()  # not marked: read as given, causal added
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    out = _attention(_config())(q, k, v, explicit)
    ref = _reference(q, k, v, explicit | causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # a query row whose every key is masked gives finite values, not NaN (megatron's masking does the same)
    everything = torch.ones(b, 1, s, s, dtype=torch.bool)
    assert torch.isfinite(_attention(_config())(q, k, v, everything)).all()


def test_rmsnorm_is_built_in_params_dtype_and_equals_the_formula():
    from megarl.megatron.layer_spec import RMSNorm

    norm = RMSNorm(_config(dtype=torch.bfloat16), 32, eps=1e-6)
    assert norm.weight.dtype == torch.bfloat16
    x = torch.randn(5, 32)
    norm32 = RMSNorm(_config(), 32, eps=1e-6)
    with torch.no_grad():
        norm32.weight.copy_(torch.rand(32))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm32.weight
    torch.testing.assert_close(norm32(x), expected)


def test_local_block_spec_uses_megarls_attention_and_norm_everywhere():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megarl.megatron.layer_spec import RMSNorm, SDPAttention, _replace, local_swaps

    # what local_block_spec does, without the pipeline state megatron's block spec reads for the layer count
    megatron_spec = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")] * 2,
        layer_norm=WrappedTorchNorm)
    spec = _replace(megatron_spec, local_swaps())
    found = set()

    def walk(obj):
        import dataclasses

        if isinstance(obj, type):
            found.add(obj)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(spec)
    assert SDPAttention in found and RMSNorm in found
    assert DotProductAttention not in found and WrappedTorchNorm not in found
    attn = spec.layer_specs[0].submodules.self_attention.submodules
    assert attn.core_attention is SDPAttention and attn.q_layernorm is RMSNorm
    assert spec.layer_norm is RMSNorm  # the final norm


@pytest.fixture
def restore_precision(monkeypatch):
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    monkeypatch.delenv(precision.TF32_ENV, raising=False)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_precision_policy_sets_torch_flags_and_the_library_override(restore_precision):
    import os

    state = precision.apply_precision(allow_tf32=True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high" and state["float32_matmul_precision"] == "high"
    assert precision.TF32_ENV not in os.environ
    state = precision.apply_precision(allow_tf32=False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    assert os.environ[precision.TF32_ENV] == "0" and state[precision.TF32_ENV] == "0"
    assert not precision.tf32_in_effect()


def test_allow_tf32_is_a_model_setting_defaulting_to_off():
    from megarl.config.schema import ModelConfig

    assert ModelConfig().allow_tf32 is False and ModelConfig(allow_tf32=True).allow_tf32 is True


def test_a_detached_copy_of_the_causal_mask_is_still_known_as_causal():
    """Activation recomputation passes attention a detached copy of the mask: it must take the same kernel path."""
    from megarl.megatron.forward import causal_inputs
    from megarl.megatron.layer_spec import is_marked_causal

    _, mask = causal_inputs(torch.ones(2, 5, dtype=torch.long))
    assert is_marked_causal(mask) and is_marked_causal(mask.detach())
    assert not is_marked_causal(torch.ones(1, 1, 5, 5, dtype=torch.bool).triu(1))
