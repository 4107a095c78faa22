"""Shared prefixes (megarl.megatron.shared_prefix): grouping, the pack's layout, attention, token budgets."""
import torch

from megarl.megatron import packing, shared_prefix
from tests.unit.test_packing import _attention

# rows 0, 2, 4 share their first 6 tokens (a prompt) and differ after; rows 1 and 5 share 3 tokens; row 3 shares
# nothing; row 6 is row 0's first 7 tokens (a row that is another's prefix)
P = [5, 6, 7, 8, 9, 10]
ROWS = [P + [1, 2, 3], [20, 21, 22, 1], P + [4, 4], [30, 31], P + [1, 9, 9, 9], [20, 21, 22, 2, 2], P + [1]]
S = max(len(r) for r in ROWS)


def _batch():
    tokens = torch.zeros(len(ROWS), S, dtype=torch.long)
    for i, r in enumerate(ROWS):
        tokens[i, :len(r)] = torch.tensor(r)
    return tokens, torch.tensor([len(r) for r in ROWS])


def test_groups_share_each_common_prefix_less_its_last_token():
    tokens, lengths = _batch()
    groups = shared_prefix.prefix_groups(tokens, lengths)
    # rows 0, 2, 4, 6 agree on 6 tokens and row 6 has 7 (row 0 and 4 agree on 7, but 2 does not): a = 6 - 1;
    # rows 1 and 5 agree on 3: a = 2; row 3 alone
    assert groups == [([0, 2, 4, 6], 5), ([1, 5], 2), ([3], 0)]
    saved = 3 * 5 + 1 * 2
    assert shared_prefix.groups_size(groups, lengths) == int(lengths.sum()) - saved
    assert packing.pack_size(lengths, multiple=4, tokens=tokens) == -(-(int(lengths.sum()) - saved) // 4) * 4


def test_grouping_prefers_the_deeper_prompt_over_a_prefix_all_rows_share():
    system = list(range(100, 110))  # a system prompt every row begins with, then two prompts of 8 samples each
    rows = [system + [1] * 20 + [2 + i] for i in range(8)] + [system + [3] * 20 + [40 + i] for i in range(8)]
    tokens = torch.tensor(rows)
    groups = shared_prefix.prefix_groups(tokens, torch.full((16,), 31))
    # one group of 16 at a = 9 saves 15 * 9 = 135; two groups of 8 at a = 29 save 2 * 7 * 29 = 406
    assert groups == [(list(range(8)), 29), (list(range(8, 16)), 29)]


def test_shared_pack_reads_every_row_back_and_keeps_each_tokens_next_token():
    tokens, lengths = _batch()
    pack = packing.pack_rows(tokens, lengths, multiple=4, share=True)
    shared = int(lengths.sum()) - 17
    assert pack.size == -(-shared // 4) * 4 and pack.links
    # every row's columns map to a packed token holding that row's token
    back = packing.unpack(pack.ids.unsqueeze(-1).float(), pack.index)[..., 0].long()
    assert torch.equal(back, tokens)
    # the position of each row's token c is c
    pos = packing.unpack(pack.positions.unsqueeze(-1).float(), pack.index)[..., 0].long()
    cols = torch.arange(S).expand(len(ROWS), S)
    assert torch.equal(pos[cols < lengths[:, None]], cols[cols < lengths[:, None]])
    # the label read for row r's column c is its token c + 1 (columns 0 .. l_r - 2)
    labels = packing.unpack(packing.packed_labels(pack).unsqueeze(-1).float(), packing.logprob_index(pack))
    keep = cols[:, :-1] < lengths[:, None] - 1
    assert torch.equal(labels[..., 0].long()[keep], tokens[:, 1:][keep])


def test_shared_attention_equals_each_row_alone():
    """q, k, v that depend on a token's row prefix only (as a causal model's do): the shared pack's attention of
    every real token equals that row attended alone."""
    attn = _attention()
    tokens, lengths = _batch()
    g = torch.Generator().manual_seed(0)
    table = {}

    def qkv(prefix: tuple):
        if prefix not in table:
            table[prefix] = (torch.randn(4, 8, generator=g), torch.randn(2, 8, generator=g),
                             torch.randn(2, 8, generator=g))
        return table[prefix]

    pack = packing.pack_rows(tokens, lengths, share=True)
    # each packed token's row prefix: the row whose column it holds (any row mapping to it: they agree)
    where = {}
    for r, n in enumerate(lengths.tolist()):
        for c in range(n):
            where.setdefault(int(pack.index[r, c]), tuple(tokens[r, :c + 1].tolist()))
    q, k, v = (torch.stack([qkv(where[i])[j] for i in range(pack.size)]) for j in range(3))
    out = attn(q, k, v, None, packed_seq_params=packing.seq_params(pack)).view(pack.size, 4, 8)
    for r, n in enumerate(lengths.tolist()):
        parts = [qkv(tuple(tokens[r, :c + 1].tolist())) for c in range(n)]
        qs, ks, vs = (torch.stack([p[j] for p in parts]).unsqueeze(1) for j in range(3))
        alone = attn(qs, ks, vs, None)[:, 0].view(n, 4, 8)
        got = out[pack.index[r, :n]]
        # the same keys and values, other kernels and summation order: a rounding unit of each softmax-weighted
        # sum of <= n values of |v| <~ 4, per summand
        assert (got - alone).abs().max().item() <= n * 4 * torch.finfo(torch.float32).eps, r


def test_budget_bins_keep_groups_together_and_split_a_group_too_large():
    rows = [[7] * 50 + [i] * 10 for i in range(6)] + [[9] * 30 for _ in range(2)]
    tokens = torch.tensor([r + [0] * (60 - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    # the first six agree on 50 tokens: a = 49, each row's own piece 11 tokens, 49 + 6 * 11 = 115 computed; rows 6
    # and 7 are equal (30 tokens): a = 29, 29 + 2 * 1 = 31
    assert shared_prefix.budget_bins(tokens, lengths, 200) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert shared_prefix.budget_bins(tokens, lengths, 120) == [[0, 1, 2, 3, 4, 5], [6, 7]]  # 115 + 31 > 120
    # at 90 the group splits: 49 + 3 * 11 = 82 twice (a fourth row would make 93), and 82 + 31 > 90
    bins = shared_prefix.budget_bins(tokens, lengths, 90)
    assert bins == [[0, 1, 2], [3, 4, 5], [6, 7]]
    for b in bins:
        assert packing.pack_size(lengths[b], tokens=tokens[b]) <= 90


def test_positioned_rope_reads_each_tokens_position():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megarl.megatron import cpu_compat

    cpu_compat.apply()  # megatron's rope puts its table on torch.cuda.current_device()

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    table = rope(12)
    shared_prefix._positioned(rope)
    assert torch.equal(rope(12), table)  # outside a shared pack: megatron's own
    pos = torch.tensor([0, 1, 2, 2, 3, 2, 3, 4, 0])
    with shared_prefix.positions(pos):
        assert torch.equal(rope(5), table[pos])
