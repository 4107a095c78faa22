"""megarl.numerics: the float32 bounds, against the formula worked by hand for small numbers."""
import math

import pytest

from megarl.numerics import (FP32_UNIT, fp32_after_step_bound, fp32_logprob_bound, fp32_output_bound,
                             fp32_relative_error, tail_factor, transformer_widths)


def test_tail_factor_is_sqrt_two_log_n():
    assert tail_factor(math.e ** 8) == pytest.approx(4.0, rel=1e-4)  # n is taken as an integer
    assert tail_factor(1) == tail_factor(2) == pytest.approx(math.sqrt(2 * math.log(2)))


def test_logprob_bound_by_hand():
    # hidden 16, one layer of inner widths 4, 9, 25 (sqrt: 2 + 3 + 5 = 10), 4 layers (sqrt 2), vocab 3 (sqrt(3/3) = 1),
    # logits RMS 2, n = e^8 / 3 positions (n * vocab = e^8: tail factor 4)
    # logit error = (sqrt(16) + 2 * 10) * u * 2 = 48 u; spread = sqrt(2) * (2 * 48 u + 1 u) = 97 sqrt(2) u
    n = math.e ** 8 / 3
    got = fp32_logprob_bound(16, [4, 9, 25], 4, 3, 2.0, n_positions=round(n))
    assert got == pytest.approx(4.0 * 97 * math.sqrt(2) * FP32_UNIT, rel=1e-3)  # rel: n rounded to an integer


def test_output_relative_and_after_step_bounds_by_hand():
    # factor (4 + 2 * 10) = 24; n = e^8: tail 4
    n = round(math.e ** 8)
    assert fp32_output_bound(16, [4, 9, 25], 4, 0.5, n) == pytest.approx(4 * math.sqrt(2) * 24 * FP32_UNIT * 0.5,
                                                                          rel=1e-4)
    assert fp32_relative_error(16, [4, 9, 25], 4, n) == pytest.approx(2 * 24 * FP32_UNIT * 4, rel=1e-4)
    assert fp32_after_step_bound(1e-5, 1e-4, 0.5) == pytest.approx(1e-5 + 5e-5)


def test_bound_grows_with_width_depth_vocab_and_logits():
    base = dict(hidden=896, layer_widths=transformer_widths(896, 14, 64, 4864, 64), layers=2, vocab=151936,
                logits_rms=1.0, n_positions=256)
    b0 = fp32_logprob_bound(**base)
    for key, value in (("hidden", 2048), ("layers", 8), ("vocab", 10 * 151936), ("logits_rms", 4.0),
                       ("n_positions", 4096)):
        assert fp32_logprob_bound(**dict(base, **{key: value})) > b0, key
    # a real model's widths stay far below a mapping error's size (O(0.1..1) nats) and above fp32's unit
    assert 100 * FP32_UNIT < b0 < 1e-3


def test_vision_error_factor_and_input_error_by_hand():
    from megarl.bridge.hf_config import VisionSpec
    from megarl.numerics import vision_error_factor

    # a flattened patch of 1 x 1 x 2 x 2 = 4 values: sqrt 2; a block's widths 16, 16, head 4, segment 25, 16, 16, MLP 9:
    # 4 + 4 + 2 + 5 + 4 + 4 + 3 = 26, four blocks: x sqrt(4); the merger's norm over 16 and sums over 2 x 2 x 16 = 64:
    # 4 + 8 + 8 = 20. Total 2 + 52 + 20 = 74
    v = VisionSpec(depth=4, hidden_size=16, num_heads=4, intermediate_size=9, out_hidden_size=8, in_channels=1,
                   patch_size=2, temporal_patch_size=1, spatial_merge_size=2)
    assert vision_error_factor(v, 25) == pytest.approx(74.0)
    # the decoder input's error adds to the logits' like a layer's: (4 + 2 * 10 + 10) * u * 2 = 68 u,
    # spread sqrt(2) * (2 * 68 u + 1 u), tail 4
    n = math.e ** 8 / 3
    got = fp32_logprob_bound(16, [4, 9, 25], 4, 3, 2.0, n_positions=round(n), input_error=10.0)
    assert got == pytest.approx(4.0 * 137 * math.sqrt(2) * FP32_UNIT, rel=1e-3)
