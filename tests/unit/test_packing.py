"""Packed micro-batches (megarl.megatron.packing): the pack's layout, the way outputs come back per row, and megarl's
SDPA core attention on a pack equal to attending each row alone (the same kernel on the same rows: float32 results
agree to the kernel's own reduction order, here bitwise or within one unit of rounding per sum)."""
import torch

from megarl.megatron import packing


def _tokens():
    tokens = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 0, 0, 0], [3, 4, 5, 0, 0]])
    return tokens, torch.tensor([5, 2, 3])


def test_pack_lays_rows_end_to_end_with_restarting_positions_and_end_padding():
    tokens, lengths = _tokens()
    pack = packing.pack_rows(tokens, lengths, multiple=4)
    assert pack.ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 0, 0]]  # 10 real tokens, padded to 12 at the end
    assert pack.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 0, 1]]
    assert pack.cu_seqlens.tolist() == [0, 5, 7, 10, 12]  # the end padding is a segment of its own
    assert pack.index.tolist() == [[0, 1, 2, 3, 4], [5, 6, -1, -1, -1], [7, 8, 9, -1, -1]]
    assert (pack.size, pack.real) == (12, 10) and packing.pack_size([5, 2, 3], 4) == 12
    assert packing.packed_labels(pack).tolist() == [[6, 7, 8, 9, 0, 2, 0, 4, 5, 0, 0, 0]]
    assert packing.logprob_index(pack).tolist() == [[0, 1, 2, 3], [5, -1, -1, -1], [7, 8, -1, -1]]
    rows, cols = packing.token_rows(pack, torch.tensor([10, 11, 12]))
    assert rows.tolist() == [10] * 5 + [11] * 2 + [12] * 3 + [-1, -1] and cols.tolist() == pack.positions[0].tolist()


def test_context_parallel_pack_pads_each_row_to_2cp_and_gives_each_rank_chunks_r_and_2cp_1_r():
    from megarl.megatron.context_parallel import chunk_positions

    tokens, lengths = _tokens()
    # CP 2: rows of 5, 2, 3 tokens padded to 8, 4, 4 (multiples of 2 * CP); multiple 4 adds no end padding
    pack = packing.pack_rows(tokens, lengths, multiple=4, cp=2, cp_rank=1)
    assert pack.segments == (8, 4, 4) and pack.size == 16
    assert pack.ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0, 1, 2, 0, 0, 3, 4, 5, 0]]
    assert pack.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert pack.index.tolist() == [[0, 1, 2, 3, 4], [8, 9, -1, -1, -1], [12, 13, 14, -1, -1]]
    # a segment of 8 in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; segments of 4: chunks of 1
    assert chunk_positions((8, 4, 4), 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 15]
    assert chunk_positions((8, 4, 4), 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    assert pack.model_ids.tolist() == [[7, 8, 9, 0, 2, 0, 4, 5]]
    assert pack.model_positions.tolist() == [[2, 3, 4, 5, 1, 2, 1, 2]]
    # the labels are the whole pack's, cut the same way: the token after position 4 (9) is row padding, 0
    assert pack.local(packing.packed_labels(pack)).tolist() == [[8, 9, 0, 0, 0, 0, 5, 0]]
    assert packing.pack_size(lengths, 4, cp=2) == 16
    rows, cols = packing.token_rows(pack, torch.tensor([10, 11, 12]))
    assert rows.tolist() == [10, 10, 10, -1, 11, -1, 12, 12] and cols.tolist() == [2, 3, 4, 5, 1, 2, 1, 2]


def test_context_parallel_pack_multiple_covers_2cp_and_cp_times_tp_under_sequence_parallelism():
    from types import SimpleNamespace

    from megarl.megatron.forward import pack_multiple

    def config(tp, sp, cp):
        return SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp, context_parallel_size=cp)

    assert pack_multiple(config(2, True, 1)) == 2
    assert pack_multiple(config(1, False, 2)) == 4  # 2 * CP chunks
    assert pack_multiple(config(2, True, 2)) == 4  # each rank's half (P / 2) splits over TP 2
    assert pack_multiple(config(4, True, 2)) == 8
    assert pack_multiple(config(2, False, 4)) == 8


def test_unpack_gathers_rows_with_zeros_past_each_row_and_keeps_gradients():
    tokens, lengths = _tokens()
    pack = packing.pack_rows(tokens, lengths)
    x = torch.arange(10, dtype=torch.float32).view(1, 10, 1).requires_grad_()
    rows = packing.unpack(x, pack.index)
    assert rows[..., 0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 0, 0, 0], [7, 8, 9, 0, 0]]
    rows.sum().backward()
    assert x.grad.flatten().tolist() == [1.0] * 10


def test_row_lengths_from_response_mask_lengths_or_width():
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert packing.row_lengths({"input_ids": ids, "response_mask": mask}).tolist() == [4, 1]
    assert packing.row_lengths({"input_ids": ids, "lengths": torch.tensor([3, 9])}).tolist() == [3, 6]
    assert packing.row_lengths({"input_ids": ids}).tolist() == [6, 6]


def _attention(causal=True):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from megarl.megatron.layer_spec import SDPAttention

    config = SimpleNamespace(context_parallel_size=1, softmax_type="vanilla", window_size=None, kv_channels=8,
                             apply_query_key_layer_scaling=False, attention_dropout=0.0)
    attn = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(attn)
    attn.config, attn.layer_number, attn.cp = config, 1, 1
    attn.attn_mask_type = AttnMaskType.causal
    attn.causal, attn.softmax_scale, attn.dropout = causal, 8 ** -0.5, 0.0
    return attn


def _count_sdpa(monkeypatch) -> list:
    """The query shapes [b, heads, s, hn] of every SDPA call from now on (the calls still compute)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q_, k_, v_, **kw):
        calls.append(tuple(q_.shape))
        return sdpa(q_, k_, v_, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def test_sdpa_on_a_pack_equals_each_row_alone_and_costs_sum_of_squares(monkeypatch):
    attn = _attention()
    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 13, 7, 2]  # two rows of one length share an SDPA call
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)  # 4 query heads
    k, v = (torch.randn(t, 2, 8, generator=g) for _ in range(2))  # 2 KV groups (GQA)
    pack = packing.pack_rows(torch.ones(len(lengths), max(lengths), dtype=torch.long), torch.tensor(lengths))
    calls = _count_sdpa(monkeypatch)
    out = attn(q, k, v, None, packed_seq_params=packing.seq_params(pack))
    assert out.shape == (t, 4 * 8)
    # score entries computed: sum of squared row lengths, never the pack's length squared
    assert sum(b * h * s * s for b, h, s, _ in calls) == 4 * sum(n * n for n in lengths)
    start = 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].unsqueeze(1) for x in (q, k, v))  # [n, 1, heads, hn]: one row alone
        alone = attn(qs, ks, vs, None)[:, 0]
        err = (out[start:start + n] - alone).abs().max().item()
        # same kernel, same row: at most a rounding unit of each softmax-weighted sum of <= n values of |v| <~ 4
        assert err <= n * 4 * torch.finfo(torch.float32).eps, (n, err)
        start += n


def test_end_padding_is_left_out_of_attention_with_zero_outputs(monkeypatch):
    """A pack of agreed size (expert-parallel ranks, the interleaved schedule) carries long end padding: attention
    computes the rows' segments only (score entries: sum of squared row lengths, nothing for the padding's 30^2),
    the padding's outputs are 0 and every real output is the unpadded pack's, bitwise (the same calls on the same
    rows)."""
    attn = _attention()
    g = torch.Generator().manual_seed(1)
    lengths = [7, 1, 13, 7]
    real, pad = sum(lengths), 30
    tokens = torch.ones(len(lengths), max(lengths), dtype=torch.long)
    padded = packing.pack_rows(tokens, torch.tensor(lengths), size=real + pad)
    bare = packing.pack_rows(tokens, torch.tensor(lengths))
    assert (padded.pad, bare.pad, padded.segments[-1]) == (pad, 0, pad)
    q = torch.randn(real + pad, 4, 8, generator=g)
    k, v = (torch.randn(real + pad, 2, 8, generator=g) for _ in range(2))
    calls = _count_sdpa(monkeypatch)
    out = attn(q, k, v, None, packed_seq_params=packing.seq_params(padded))
    assert sum(b * h * s * s for b, h, s, _ in calls) == 4 * sum(n * n for n in lengths)
    assert out.shape == (real + pad, 32) and not out[real:].any()
    alone = attn(q[:real], k[:real], v[:real], None, packed_seq_params=packing.seq_params(bare))
    assert torch.equal(out[:real], alone)
    mask = packing.padding_mask(padded)
    assert mask.shape == (1, real + pad) and mask[0].tolist() == [False] * real + [True] * pad
    assert packing.padding_mask(bare) is None


def test_context_parallel_pack_end_padding_is_the_last_pad_over_cp_tokens_of_each_rank():
    from megarl.megatron.context_parallel import chunk_positions

    tokens = torch.ones(2, 9, dtype=torch.long)
    for r in range(2):
        pack = packing.pack_rows(tokens, torch.tensor([9, 3]), multiple=4, size=32, cp=2, cp_rank=r)
        assert pack.segments == (12, 4, 16) and pack.pad == 16  # rows padded to 2*CP, then the end padding
        local = chunk_positions(pack.segments, 2, r)
        assert (local >= 16).tolist() == packing.padding_mask(pack)[0].tolist()  # the padding: the share's last 8
