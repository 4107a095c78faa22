"""Routing replay's pure parts (megarl.megatron.router_replay), its validate rules and verl's keys; hand-derived values.
The replay inside megatron's routers is checked against HF transformers in tests/dist/test_router_replay.py."""
import torch

from megarl.config import load_config
from megarl.config.checks import check_router_replay
from megarl.convert_verl import convert
from megarl.megatron import router_replay as rr


def test_replay_topk_uses_the_target_where_complete_and_the_router_elsewhere():
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4],
                           [1.0, 2.0, 3.0, 4.0],
                           [5.0, 6.0, 7.0, 8.0]])
    probs = torch.tensor([[0.4, 0.3], [4.0, 3.0], [8.0, 7.0]])  # the router's own top-2
    idx = torch.tensor([[3, 2], [3, 2], [3, 2]])
    target = torch.tensor([[0, 1], [2, -1], [3, 2]])  # row 1: incomplete route -> the router's choice
    p, i, replayed = rr.replay_topk(scores, probs, idx, target)
    assert i.tolist() == [[0, 1], [3, 2], [3, 2]]
    assert torch.allclose(p, torch.tensor([[0.1, 0.2], [4.0, 3.0], [8.0, 7.0]]))
    assert replayed.tolist() == [True, False, True]


def test_same_experts_ignores_the_order_within_top_k():
    a = torch.tensor([[0, 1], [2, 3], [1, 3]])
    b = torch.tensor([[1, 0], [2, 1], [3, 1]])
    assert rr.same_experts(a, b).tolist() == [True, False, True]


def test_need_mask_is_every_real_token_but_the_last():
    assert rr.need_mask(torch.tensor([3, 1, 5]), 5).int().tolist() == [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0],
                                                                       [1, 1, 1, 1, 0]]


def test_metrics_shares():
    m = rr.metrics("update", rr.ReplayCounts(needed=10, with_route=8, agree=6, replayed=8))
    assert m == {"router_replay/update_replayed_share": 0.8, "router_replay/update_fallback_share": 0.2,
                 "router_replay/update_agreement": 0.75}
    assert rr.metrics("old_log_prob", rr.ReplayCounts(needed=10), recorded=True) == {
        "router_replay/old_log_prob_replayed_share": 0.0}


def test_micro_batch_slices_routes_by_global_row_and_pads():
    routes = torch.arange(3 * 4 * 2 * 1).view(3, 4, 2, 1).to(torch.int16)
    need = torch.ones(3, 4, dtype=torch.bool)
    rr.begin("replay", 3, 4, routes=routes, need=need, num_layers=2, topk=1)
    try:
        rr.micro_batch(torch.tensor([2, -1]), 6)  # row 2, then a padding row; 2 padded positions
        st = rr.STATE
        assert st._mb_routes.shape == (2, 6, 2, 1)
        assert st._mb_routes[0, :4].flatten().tolist() == routes[2].flatten().tolist()
        assert (st._mb_routes[0, 4:] == -1).all() and (st._mb_routes[1] == -1).all()
        assert st._mb_need.tolist() == [[True] * 4 + [False] * 2, [False] * 6]
    finally:
        rr.end()
    assert rr.STATE.action == "off"


def _cfg(mode, **extra):
    return load_config(data={"model": {"path": "x"}, "actor": {"router_replay": {"mode": mode}}, **extra},
                       check=False)


def test_validate_refuses_r3_dense_models_and_recompute(tmp_path):
    assert check_router_replay(_cfg("none")) == []
    (r3,) = check_router_replay(_cfg("R3"))
    assert r3.key == "actor.router_replay.mode" and "routed experts" in r3.rule and "R2" in r3.fix
    assert check_router_replay(_cfg("R2")) == []  # model shape unknown: nothing to object to
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "num_hidden_layers": 2}')  # dense
    (dense,) = check_router_replay(_cfg("R2", model={"path": str(tmp_path)}))
    assert "has none" in dense.rule
    (rec,) = check_router_replay(_cfg("R2", model={"path": "x", "recompute": "full"}))
    assert "model.recompute" in rec.keys


def test_convert_verl_maps_the_mode_and_drops_the_engine_switch():
    c = convert({"actor_rollout_ref.actor.megatron.router_replay.mode": "R2",
                 "actor_rollout_ref.rollout.enable_rollout_routing_replay": False})
    assert c.recipe["actor"]["router_replay"]["mode"] == "R2" and not c.refused
    assert any(line.startswith("actor_rollout_ref.rollout.enable_rollout_routing_replay") for line in c.dropped)
    c = convert({"actor_rollout_ref.actor.megatron.router_replay.mode": "disabled"})
    assert c.recipe["actor"]["router_replay"]["mode"] == "none"


def test_token_budget_forward_reports_each_groups_rows():
    from megarl.batching import forward_by_token_budget

    seen = []
    tokens = torch.arange(4 * 6).view(4, 6)
    lengths = torch.tensor([6, 2, 5, 3])
    out = forward_by_token_budget(lambda x, mb: x.float(), tokens, lengths, 8, 6, on_rows=lambda idx: seen.append(
        idx.tolist()))
    rows = sorted(r for group in seen for r in group)
    assert rows == [0, 1, 2, 3] and len(seen) > 1  # every row once, in several groups
    assert torch.equal(out[:, :2], tokens[:, :2].float())
