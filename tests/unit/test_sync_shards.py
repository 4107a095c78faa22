"""The weight-sync plan: hand-computed byte counts for a tiny config, engine facts (padded vocab, replicated KV heads,
experts under EP), buckets, the CLI. No processes."""
import json

import pytest

from megarl.bridge.hf_config import spec_from_dict
from megarl.bridge.mapping import Mapping
from megarl.sync.plan import build_plan, main
from megarl.sync.boxes import box_numel, intersect, split_rows
from megarl.sync.moves import Move, bucket_moves, plan_moves
from megarl.sync.shards import engine_needs, predict_engine_modules

# hidden 8, 2 heads x head_dim 4, 2 KV heads, ffn 16, vocab 32, 2 layers, untied. Elements per layer:
# q 64 + k 64 + v 64 + o 64 + gate 128 + up 128 + down 128 = 640 split, 2 norms x 8 = 16 replicated.
# embed 256 + lm_head 256 (vocab split) + final norm 8 = 520. Total 2 * 656 + 520 = 1832 elements.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32,
        "tie_word_embeddings": False, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def test_one_rank_one_engine_loads_the_whole_model_locally():
    plan = build_plan(TINY, dtype="float32")
    sent, received, loaded = plan.traffic()
    assert plan.total_bytes == 1832 * 4 and loaded == {0: 1832 * 4}
    assert not sent and not received


def test_trainer_tp2_into_engine_tp2_moves_nothing_between_ranks():
    # each TP rank holds exactly its engine worker's shard (same head and row splits); megatron's padded vocab (128
    # rows, 64 per rank) puts all 32 real rows on rank 0, as does vLLM's (64 rows, 32 per rank)
    plan = build_plan(TINY, tp=2, engine_tp=2, dtype="float32")
    sent, received, loaded = plan.traffic()
    assert not sent and not received
    assert loaded == {0: (2 * (320 + 16) + 256 + 256 + 8) * 4, 1: (2 * (320 + 16) + 8) * 4}


def test_pp2_into_engine_tp2_hand_counts():
    # rank 0 = stage 0 (embed, layer 0), rank 1 = stage 1 (layer 1, final norm, lm_head); worker w on rank w
    plan = build_plan(TINY, pp=2, engine_tp=2, dtype="float32")
    sent, received, loaded = plan.traffic()
    # worker 0 needs from rank 1: layer 1's first halves 320 + its norms 16 + final norm 8 + lm_head rows 0-31 256
    # worker 1 needs from rank 0: layer 0's second halves 320 + its norms 16 (no vocab rows: 32..63 are padding)
    assert received == {0: 600 * 4, 1: 336 * 4} and sent == {1: 600 * 4, 0: 336 * 4}
    assert loaded == {0: 1192 * 4, 1: 680 * 4}
    o = [mv for mv in plan.moves if mv.hf == "model.layers.0.self_attn.o_proj.weight"]
    assert {(mv.dst, mv.box) for mv in o} == {(0, ((0, 8), (0, 4))), (1, ((0, 8), (4, 8)))}  # row-parallel: dim 1


def test_two_replicas_receive_only_their_shard():
    # trainer TP2 over 2 ranks, engine TP1: two replicas, each worker needs the whole model; its rank holds half
    plan = build_plan(TINY, tp=2, engine_tp=1, dtype="float32")
    sent, received, loaded = plan.traffic()
    assert plan.replicas == 2 and loaded == {0: 1832 * 4, 1: 1832 * 4}
    assert received == {0: 640 * 4, 1: (640 + 512) * 4}  # rank 1 holds no vocabulary row (all on rank 0)
    assert all(received[r] <= loaded[r] for r in received)


def test_engine_facts_padded_vocab_and_replicated_kv_heads():
    # 4 query heads, a single KV head, a prime vocabulary, engine TP4: vLLM pads 307 to 320 (80 rows per rank) and
    # replicates the KV head on every rank
    spec = spec_from_dict(dict(TINY, num_attention_heads=4, num_key_value_heads=1, head_dim=4, hidden_size=16,
                               vocab_size=307))
    mapping = Mapping(spec)
    needs = [engine_needs(mapping, predict_engine_modules(mapping, 4, 1, w)) for w in range(4)]
    assert [n["lm_head.weight"][0] for n in needs] == [(0, 80), (80, 160), (160, 240), (240, 307)]
    assert [n["model.layers.0.self_attn.q_proj.weight"][0] for n in needs] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert all(n["model.layers.0.self_attn.k_proj.weight"] == ((0, 4), (0, 16)) for n in needs)


def test_experts_under_engine_ep_and_tp():
    cfg = dict(TINY, architectures=["Qwen3MoeForCausalLM"], num_experts=4, moe_intermediate_size=8,
               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    mapping = Mapping(spec_from_dict(cfg))
    ep = [engine_needs(mapping, predict_engine_modules(mapping, 2, 2, w)) for w in range(2)]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in ep[1] and "model.layers.0.mlp.experts.3.up_proj.weight" \
        not in ep[0]
    assert ep[1]["model.layers.0.mlp.experts.3.down_proj.weight"] == ((0, 8), (0, 8))  # whole expert
    tp = [engine_needs(mapping, predict_engine_modules(mapping, 2, 1, w)) for w in range(2)]
    assert tp[1]["model.layers.0.mlp.experts.3.down_proj.weight"] == ((0, 8), (4, 8))  # split on the expert's ffn
    assert tp[1]["model.layers.0.mlp.experts.3.gate_proj.weight"] == ((4, 8), (0, 8))
    plan = build_plan(cfg, ep=2, engine_tp=2, engine_ep=2, dtype="float32")
    sent, received, loaded = plan.traffic()
    assert sum(loaded.values()) == sum(mv.nbytes for mv in plan.moves)
    with pytest.raises(ValueError, match="must equal the engine's tensor parallel size"):
        build_plan(cfg, world=2, engine_ep=2)
    with pytest.raises(ValueError, match="needs an MoE model"):
        build_plan(TINY, ep=2)


def test_pieces_cover_every_need_exactly_and_buckets_are_bounded():
    holdings = {"w": [(0, ((0, 4), (0, 6))), (1, ((4, 8), (0, 6))), (2, ((0, 4), (0, 6))), (3, ((4, 8), (0, 6)))]}
    needs = {0: {"w": ((0, 8), (0, 6))}, 2: {"w": ((2, 6), (0, 6))}}
    moves = plan_moves(["w"], needs, holdings, {"w": 4})
    for dst, want in ((0, ((0, 8), (0, 6))), (2, ((2, 6), (0, 6)))):
        mine = [mv for mv in moves if mv.dst == dst]
        assert sum(box_numel(mv.box) for mv in mine) == box_numel(want)
        assert all(intersect(mv.box, mv.holding) == mv.box for mv in mine)
    assert {mv.src for mv in moves if mv.dst == 2} == {2, 3}  # the receiver's own rows first, then a peer's
    with pytest.raises(ValueError, match="hold 24 of the 48 elements"):
        plan_moves(["w"], {0: {"w": ((0, 8), (0, 6))}}, {"w": holdings["w"][:1]}, {"w": 4})
    big = [Move("e", 0, 0, ((0, 100), (0, 10)), ((0, 100), (0, 10)), 4000), Move("n", 0, 0, ((0, 10),), ((0, 10),), 40)]
    buckets = bucket_moves(big, 1000)
    assert all(sum(mv.nbytes for mv in b) <= 1000 for b in buckets)
    assert sum(box_numel(mv.box) for b in buckets for mv in b if mv.hf == "e") == 1000
    assert split_rows(((0, 5), (0, 3)), 6) == [((0, 2), (0, 3)), ((2, 4), (0, 3)), ((4, 5), (0, 3))]


def test_cli_prints_plan(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert main(["--hf-config", str(path), "--pp", "2", "--engine-tp", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "trainer TP1 PP2 EP1 on 2 ranks -> 1 engine replica(s) of TP2" in out and "2,400 B" in out, out
    assert main(["--hf-config", str(tmp_path / "missing.json")]) == 1


def test_separate_engine_gpus_receive_their_whole_shard_from_the_trainer():
    # trainer TP1 on 2 ranks (data parallel: both hold the whole model) -> one engine of TP2 on GPUs of its own,
    # receivers 2 and 3. Engine TP2 shards (as in test_pp2_into_engine_tp2_hand_counts): worker 0 1192 elements
    # (layer halves, norms, vocab rows 0-31 of embed and head, final norm), worker 1 680 (no real vocabulary row)
    plan = build_plan(TINY, world=2, engine_tp=2, dtype="float32", separate=True)
    sent, received, loaded = plan.traffic()
    assert loaded == received == {2: 1192 * 4, 3: 680 * 4}  # nothing is local: every byte comes from a trainer GPU
    assert set(sent) == {0, 1} and sum(sent.values()) == (1192 + 680) * 4
    assert max(sent.values()) < 0.75 * (1192 + 680) * 4  # the two copies share the sending
    assert "engine 0" in plan.summary() and "on 2 GPUs of their own" in plan.summary()
    # two replicas: each engine GPU gets the whole model, the trainer GPUs send two copies between them
    plan = build_plan(TINY, world=2, replicas=2, dtype="float32", separate=True)
    sent, received, loaded = plan.traffic()
    assert loaded == received == {2: 1832 * 4, 3: 1832 * 4} and sum(sent.values()) == 2 * 1832 * 4


def test_fused_vision_qkv_is_read_whole_by_a_single_engine_rank():
    # The Qwen2.5-VL vision tower's attention keeps q, k and v in one checkpoint tensor `attn.qkv` [3 x 64, 64]
    # (2 heads x 32); vLLM loads it into a QKV layer. A single engine rank reads all 192 rows (reading it as one
    # projection gave rows 0-64 only: k and v never reached the engine); over engine TP2 each rank would need three
    # row blocks, which is refused with the setting that works.
    from megarl.bridge.tiny import tiny_vl_config
    from megarl.sync.shards import EngineModule

    config = tiny_vl_config(300, image_token_id=290, video_token_id=291, vision_start_token_id=288,
                            vision_end_token_id=289).to_dict()
    mapping = Mapping(spec_from_dict(config))
    qkv = "visual.blocks.0.attn.qkv"
    one = {qkv: EngineModule("qkv", 0, 1, heads=2, kv_heads=2, kv_replicas=1, head_size=32)}
    # vLLM's Qwen2.5-VL and Qwen3-VL declare the already-fused tensor as a packed module of itself
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"], "qkv": ["qkv"]}
    for p in (None, packed):
        needs = engine_needs(mapping, one, p)
        assert needs[qkv + ".weight"] == ((0, 192), (0, 64))
        assert needs[qkv + ".bias"] == ((0, 192),)
    two = {qkv: EngineModule("qkv", 0, 2, heads=1, kv_heads=1, kv_replicas=1, head_size=32)}
    with pytest.raises(ValueError, match="rollout.tensor_model_parallel_size=1"):
        engine_needs(mapping, two, packed)
