"""Routing replay's pure parts (megarl.megatron.router_replay), its validate rules and verl's keys; hand-derived values.
The replay inside megatron's routers is checked against HF transformers in tests/dist/test_router_replay.py."""
import json

import torch

from megarl.config import load_unchecked
from megarl.megatron.checks import check_router_replay
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


def test_micro_batch_takes_routes_in_packed_order():
    routes = torch.arange(3 * 4 * 2 * 1).view(3, 4, 2, 1).to(torch.int16)
    need = torch.ones(3, 4, dtype=torch.bool)
    need[:, 3] = False
    rr.begin("replay", 3, 4, routes=routes, need=need, num_layers=2, topk=1)
    try:
        # a pack of row 2 (4 tokens), row 0 (2 tokens), then 2 tokens of end padding
        rr.micro_batch(torch.tensor([2, 2, 2, 2, 0, 0, -1, -1]), torch.tensor([0, 1, 2, 3, 0, 1, 0, 1]))
        st = rr.STATE
        assert st._mb_routes.shape == (1, 8, 2, 1)
        assert st._mb_routes[0, :4].flatten().tolist() == routes[2].flatten().tolist()
        assert st._mb_routes[0, 4:6].flatten().tolist() == routes[0, :2].flatten().tolist()
        assert (st._mb_routes[0, 6:] == -1).all()
        assert st._mb_need.tolist() == [[True, True, True, False, True, True, False, False]]
    finally:
        rr.end()
    assert rr.STATE.action == "off"


def test_record_writes_packed_tokens_back_to_their_rows():
    rr.begin("record", 2, 3, need=torch.ones(2, 3, dtype=torch.bool), num_layers=1, topk=1)
    try:
        rr.micro_batch(torch.tensor([1, 1, 1, 0, 0, -1]), torch.tensor([0, 1, 2, 0, 1, 0]))
        layer = rr.LayerReplay(0, sequence_parallel=False)
        scores = torch.zeros(6, 4)
        chosen = torch.tensor([3, 2, 1, 0, 3, 2])
        scores[torch.arange(6), chosen] = 1.0

        def topk(s, k, num_groups=None, group_topk=None):
            return torch.topk(s, k)

        layer.get_replay_topk(scores, 1, default_compute_topk=topk)
        assert rr.STATE.recorded[..., 0, 0].tolist() == [[0, 3, -1], [3, 2, 1]]
    finally:
        rr.end()


def _cfg(mode, **extra):
    return load_unchecked(data={"model": {"path": "x"}, "actor": {"router_replay": {"mode": mode}}, **extra})


def test_validate_refuses_dense_models_and_recompute(tmp_path):
    assert check_router_replay(_cfg("none")) == []
    assert check_router_replay(_cfg("R2")) == []  # model shape unknown: nothing to object to
    assert check_router_replay(_cfg("R3")) == []
    assert _cfg("R3").routes_from_engine and not _cfg("R2").routes_from_engine  # R3 turns the engine's routes on
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "intermediate_size": 128}  # dense
    (tmp_path / "config.json").write_text(json.dumps(llama))
    (dense,) = check_router_replay(_cfg("R2", model={"path": str(tmp_path)}))
    assert "has none" in dense.rule
    (dense_r3,) = check_router_replay(_cfg("R3", model={"path": str(tmp_path)}))
    assert dense_r3.key == "actor.router_replay.mode" and "MoE" in dense_r3.rule
    (dense_routes,) = check_router_replay(_cfg("none", model={"path": str(tmp_path)},
                                               rollout={"return_routed_experts": True}))
    assert dense_routes.key == "rollout.return_routed_experts" and "false" in dense_routes.fix
    (rec,) = check_router_replay(_cfg("R2", model={"path": "x", "recompute": "full"}))
    assert "model.recompute" in rec.keys


def test_validate_refuses_r3_where_the_engine_routes_are_not_assembled():
    (off,) = check_router_replay(_cfg("R3", rollout={"return_routed_experts": False}))
    assert "rollout.return_routed_experts" in off.keys and "R2" in off.fix
    (mt,) = check_router_replay(_cfg("R3", rollout={"multi_turn": {"enable": True}}))
    assert "rollout.multi_turn.enable" in mt.keys
    (resume,) = check_router_replay(_cfg("R3", async_training={"partial_rollout": "abort_resume"}))
    assert "async_training.partial_rollout" in resume.keys and "finish" in resume.fix


def test_assemble_routes_by_position_and_from_same_prompt_siblings():
    from megarl.batching import route_coverage
    from megarl.rollout.vllm.engine import assemble_routes

    layers, k = 2, 1
    a = torch.tensor([[[0], [1]], [[1], [0]], [[0], [0]], [[1], [1]]], dtype=torch.int16)  # 4 positions
    b = a.clone()
    b[:2] = -1  # positions 0-1 came from the prefix cache: not forwarded for this row
    b[2] = torch.tensor([[1], [1]])
    # row 0: prompt [7, 8, 9] + 2 response tokens (4 forwarded positions, the last token is not forwarded)
    # row 1: the same prompt, other response; row 2: another prompt, nothing recorded
    out = assemble_routes([a.numpy(), b.numpy(), None], [[7, 8, 9], [7, 8, 9], [7, 8]], [5, 4, 3], layers, k)
    assert out.shape == (3, 5, 2, 1) and out.dtype == torch.int16
    assert torch.equal(out[0, :4], a) and (out[0, 4] == -1).all()
    assert torch.equal(out[1, :2], a[:2])  # the prompt positions the prefix cache skipped: row 0's
    assert out[1, 2].flatten().tolist() == [1, 1]  # its own
    assert (out[1, 3:] == -1).all()  # position 3 is row 1's last token (length 4): never forwarded
    assert (out[2] == -1).all()
    assert route_coverage(out, torch.tensor([5, 4, 3])) == (4 + 3 + 0) / (4 + 3 + 2)


def test_rollout_batch_carries_routes_through_select_concat_and_the_train_batch():
    from megarl.batching import build_train_batch
    from megarl.types import RolloutBatch

    def batch(routes, width):
        n = routes.shape[0]
        return RolloutBatch(prompt_ids=[[5, 6]] * n, response_ids=torch.ones(n, width, dtype=torch.long),
                            response_lengths=torch.full((n,), width), rollout_logprobs=None,
                            finish_reasons=["stop"] * n, truncated=torch.zeros(n, dtype=torch.bool),
                            prompt_index=torch.arange(n), prompt_truncated=torch.zeros(n, dtype=torch.bool),
                            routed_experts=routes)

    r1 = torch.arange(2 * 3 * 1 * 2, dtype=torch.int16).view(2, 3, 1, 2)
    r2 = torch.full((1, 4, 1, 2), 9, dtype=torch.int16)
    both = RolloutBatch.concat([batch(r1, 1), batch(r2, 2)])
    assert both.routed_experts.shape == (3, 4, 1, 2)
    assert torch.equal(both.routed_experts[:2, :3], r1) and (both.routed_experts[:2, 3] == -1).all()
    assert torch.equal(both.select([2]).routed_experts, r2)
    train = build_train_batch(both, torch.zeros(3), 0)
    assert train["routed_experts"].shape == (3, 4, 1, 2)  # S = 2 + 2 tokens: input_ids' columns
    assert torch.equal(train["routed_experts"], both.routed_experts)


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
    out = forward_by_token_budget(lambda x, mb, lens: x.float(), tokens, lengths, 8, 6, on_rows=lambda idx: seen.append(
        idx.tolist()))
    rows = sorted(r for group in seen for r in group)
    assert rows == [0, 1, 2, 3] and len(seen) > 1  # every row once, in several groups
    assert torch.equal(out[:, :2], tokens[:, :2].float())
