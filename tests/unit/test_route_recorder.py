"""The routed-experts recorder of the V1 runner (megarl.rollout.vllm.routes.RouteRecorder), without vLLM: a stand-in
capturer whose step buffer holds the value 100 * row + 10 * layer + k at [row, layer, k], so every expected route is
written from its row, layer and slot by hand."""
from types import SimpleNamespace

import torch

from megarl.rollout.vllm.routes import RouteRecorder

LAYERS, TOP_K = 3, 2
MOE = torch.tensor([True, False, True])  # layer 1 is dense: the capturer never writes it


def capturer(rows: int, base: int = 0):
    value = base + torch.arange(rows)[:, None, None] * 100 + torch.arange(LAYERS)[None, :, None] * 10 \
        + torch.arange(TOP_K)[None, None, :]
    value[:, 1] = 0  # what the buffer holds in a layer no router wrote
    return SimpleNamespace(device_buffer=value.to(torch.int32))


def route(row: int, base: int = 0) -> list:
    return [[-1, -1] if layer == 1 else [base + 100 * row + 10 * layer + k for k in range(TOP_K)]
            for layer in range(LAYERS)]


def test_each_request_gets_its_rows_by_position_and_dense_layers_read_minus_one():
    rec = RouteRecorder(capturer(8), MOE, keep=True)
    # request a owns rows 0..2 (positions 0, 1, 2), request b rows 3..4 (positions 4, 5: its prefix was cached)
    rec.after_step(["a", "b"], [0, 3, 5], torch.tensor([0, 1, 2, 4, 5, 9, 9, 9]), 5)
    a, b = rec.take(["a", "b"])
    assert a.dtype == torch.int16
    assert a.tolist() == [route(0), route(1), route(2)]
    assert b.tolist() == [[[-1, -1]] * LAYERS] * 4 + [route(3), route(4)]
    assert rec.take(["a", "b"]) == [None, None]  # taken routes are forgotten


def test_a_recomputed_request_overwrites_its_positions_and_a_later_one_grows_the_rows():
    rec = RouteRecorder(capturer(4), MOE, keep=True)
    rec.after_step(["a"], [0, 3], torch.tensor([0, 1, 2]), 3)
    rec.capturer = capturer(4, base=1000)  # the next step routes differently
    rec.after_step(["a"], [0, 2], torch.tensor([1, 5]), 2)  # position 1 recomputed, position 5 new
    (a,) = rec.take(["a"])
    # capacity doubles from 3 to 6; positions 3 and 4 were never forwarded
    assert a.tolist() == [route(0), route(0, 1000), route(2), [[-1, -1]] * LAYERS, [[-1, -1]] * LAYERS,
                          route(1, 1000)]


def test_a_rank_that_does_not_keep_routes_stores_nothing():
    rec = RouteRecorder(capturer(4), MOE, keep=False)
    rec.after_step(["a"], [0, 2], torch.tensor([0, 1]), 2)
    assert rec.steps == 1 and rec.routes_of == {}
