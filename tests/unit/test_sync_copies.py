"""The compiled copy list (megarl.sync.copies): every piece cut by strided views of its parameter equals the piece
the bridge mapping itself gives from the same weights (Mapping.shard_to_hf, the reference the bridge parity tests
hold against HF transformers), for every layout kind: plain, vocabulary, gate/up, fused q/k/v with GQA, and MLA's
rotary row permutation, at TP 1, 2 and 4, for whole chunks and for row and column blocks of them."""
import pytest
import torch

from megarl.bridge import Mapping, spec_from_dict
from megarl.bridge.mapping import padded_vocab_size
from megarl.sync.boxes import full_box, relative_slices
from megarl.sync.copies import Strided, compile_cuts, region_target, row_blocks
from megarl.sync.shards import SyncTable

GQA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 8,
       "num_key_value_heads": 4, "head_dim": 2, "intermediate_size": 24, "vocab_size": 37,
       "tie_word_embeddings": False, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
MLA = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, intermediate_size=32, moe_intermediate_size=8, vocab_size=40, q_lora_rank=None,
           kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=8, v_head_dim=4, n_routed_experts=4,
           n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
           routed_scaling_factor=1.0, first_k_dense_replace=1, num_nextn_predict_layers=0, rope_interleave=False,
           max_position_embeddings=64, rms_norm_eps=1e-6)


def _sub_boxes(box):
    """The chunk itself, its second half of rows, and a column block: the cuts a plan makes (needs of another TP,
    row blocks of a bucket)."""
    out = [box]
    (r0, r1), rest = box[0], box[1:]
    if r1 - r0 > 1:
        out.append(((r0 + (r1 - r0) // 2, r1),) + rest)
    if rest and rest[0][1] - rest[0][0] > 1:
        c0, c1 = rest[0]
        out.append(((r0, r1), (c0 + 1, c1)) + rest[1:])
    return out


KINDS = {"qkv", "gate_up", "vocab", "plain"}


@pytest.mark.parametrize("config,tp,kinds", [(GQA, 1, KINDS), (GQA, 2, KINDS), (GQA, 4, KINDS), (MLA, 1, {"rope"}),
                                            (MLA, 2, {"rope"})])
def test_cuts_equal_the_mappings_own_pieces(config, tp, kinds):
    spec = spec_from_dict(config)
    mapping = Mapping(spec, padded_vocab=padded_vocab_size(spec.vocab_size, tp))  # megatron's padded rows
    table = SyncTable.of(mapping)
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for entry in mapping.entries:
        split = entry.tp_dim is not None and tp > 1
        for tp_rank in range(tp if split else 1):
            shape = mapping.megatron_shape(entry, tp if split else 1)
            weight = torch.randn(shape, generator=gen)
            reference = dict(mapping.shard_to_hf(entry, weight, tp_rank, tp if split else 1))
            held = table.held(entry, tp_rank, tp if split else 1)
            pieces = [(hf, box, holding, entry, tuple(shape), tp_rank, tp if split else 1)
                      for hf, holding in zip(entry.hf, held) if all(b > a for a, b in holding)
                      for box in _sub_boxes(holding)]
            cuts = compile_cuts(mapping, pieces)
            for hf, box, holding, *_ in pieces:
                cut = cuts[(hf, box)]
                want = reference[hf][relative_slices(box, holding)]
                assert cut.param == entry.megatron
                assert torch.equal(cut.piece(weight), want), (hf, box)
                out = torch.full(want.shape, float("nan"))
                assert cut.piece(weight, out=out) is out and torch.equal(out, want)
            seen.add(entry.kind)
    assert kinds <= seen


def test_qkv_pieces_are_one_block_per_kv_group():
    # 4 KV groups of 2 query heads x head_dim 2: q rows interleave with k and v in megatron's fused layout
    mapping = Mapping(spec_from_dict(GQA))
    entry = mapping.by_hf["model.layers.0.self_attn.q_proj.weight"]
    held = SyncTable.of(mapping).held(entry, 0, 1)
    cuts = compile_cuts(mapping, [(h, b, b, entry, tuple(mapping.megatron_shape(entry, 1)), 0, 1)
                                  for h, b in zip(entry.hf, held)])
    q, k = cuts[(entry.hf[0], held[0])], cuts[(entry.hf[1], held[1])]
    # a group is (2 + 1 + 1) * 2 = 8 rows of 16: q's 4 rows start at rows 0, 8, 16, 24; k's 2 rows after them
    assert [(a, b, s.offset, s.strides) for a, b, s in q.blocks] == [(4 * g, 4 * g + 4, 128 * g, (16, 1))
                                                                      for g in range(4)]
    assert [(a, b, s.offset) for a, b, s in k.blocks] == [(2 * g, 2 * g + 2, 128 * g + 64) for g in range(4)]


def test_row_blocks_of_a_permutation_and_refusals():
    pos = torch.arange(12).view(6, 2)[torch.tensor([0, 1, 2, 5, 4, 3])]
    blocks = row_blocks(pos)
    # rows 5, 4, 3 run backwards: one block each (a strided view has no negative stride)
    assert [(a, b) for a, b, _ in blocks] == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert blocks[0][2] == Strided(0, (3, 2), (2, 1))
    base = torch.arange(12.0).view(6, 2)
    assert torch.equal(torch.cat([s.of(base) for _, _, s in blocks]), base[torch.tensor([0, 1, 2, 5, 4, 3])])
    with pytest.raises(ValueError, match="rows are not alike"):
        row_blocks(torch.tensor([[0, 1], [2, 4]]))  # the second row is laid out otherwise


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_region_targets_are_the_wire_formats_regions(dtype):
    """A compiled file target is the same view of a bucket file as the wire format's region sliced to the box (the
    view both sides read), for boxes of rows, columns and the whole tensor, at a region past the file's start."""
    from megarl.sync.wire import region

    buf = torch.zeros(4096, dtype=torch.uint8)
    shape, offset = (6, 10), 128
    region(buf, dtype, shape, offset).copy_(torch.arange(60).view(shape))  # distinct values, no NaN bit patterns
    for box in (full_box(shape), ((2, 5), (0, 10)), ((0, 6), (3, 7)), ((4, 5), (9, 10))):
        want = region(buf, dtype, shape, offset)[relative_slices(box, full_box(shape))]
        got = region_target(offset, dtype, shape, box).of(buf)
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)
