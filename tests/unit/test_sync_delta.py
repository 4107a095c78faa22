"""megarl.sync.delta: the changed elements of a piece, by bits, sent in whichever format takes the fewest bytes, and
decoded to the same bits on both sides."""
import pytest
import torch

from megarl.sync.delta import (DENSE, INDICES, MASK, RUNS, SAME, apply, changed_mask, checksum, encode,
                               encoded_bytes, pack_mask, payload, run_indices, runs_of, unpack_mask)


def _roundtrip(piece, last):
    """Encode against `last`, move every tensor through a fresh buffer as a receiver would, decode into a copy of
    `last`: (entry, bytes sent, the decoded piece)."""
    entry, tensors = encode(piece, last)
    received = []
    for (numel, dtype), t in zip(payload(entry, piece.numel(), piece.dtype), tensors, strict=True):
        buf = torch.empty(numel, dtype=dtype)
        buf.copy_(t.reshape(-1))
        received.append(buf)
    mirror = last.clone() if last is not None else torch.empty_like(piece)
    apply(mirror, entry, received)
    return entry, sum(t.numel() * t.element_size() for t in received), mirror


def test_changes_are_found_by_bits_and_applied_exactly():
    last = torch.tensor([[1.0, -0.0, float("nan")], [2.0, 3.0, 4.0]] * 4, dtype=torch.bfloat16)
    piece = last.clone()
    piece[0, 1] = 0.0  # -0.0 -> 0.0: equal as values, other bits
    piece[5, 2] = 4.03125  # the next bfloat16 after 4.0
    assert torch.nonzero(changed_mask(piece, last)).view(-1).tolist() == [1, 17]
    entry, nbytes, mirror = _roundtrip(piece, last)  # indices 2 x (4 + 2) = 12 bytes; mask 3 + 4 = 7 bytes
    assert entry == (MASK, 2, 2) and nbytes == 7
    assert torch.equal(mirror.view(torch.int16), piece.view(torch.int16))


@pytest.mark.parametrize("changed,kind", [
    (lambda n: [3], INDICES),                        # one change: 6 bytes as an index, a mask alone is n / 8
    (lambda n: list(range(0, n, 3)), MASK),          # every third: indices 6 B each, mask n / 8 + 2 B each
    (lambda n: list(range(100, 400)), RUNS),         # one stretch: 8 bytes of run and the values
    (lambda n: list(range(n)), DENSE),               # all of it
    (lambda n: [], SAME),
])
def test_each_format_is_chosen_where_it_takes_the_fewest_bytes_and_decodes_exactly(changed, kind):
    n = 1024
    last = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    piece = last.clone()
    idx = torch.tensor(changed(n), dtype=torch.long)
    piece[idx] = (piece[idx].float() + 1.0).to(torch.bfloat16)
    entry, nbytes, mirror = _roundtrip(piece, last)
    k = idx.numel()
    runs = int(runs_of(changed_mask(piece, last))[0].numel())
    assert entry[0] == kind and entry[1] == (k if kind != DENSE or k else n)
    assert nbytes == encoded_bytes(kind, n, 2, k, runs)
    assert nbytes == min(encoded_bytes(x, n, 2, k, runs) for x in (DENSE, INDICES, MASK, RUNS)) or kind == SAME
    assert torch.equal(mirror.view(torch.int16), piece.view(torch.int16))
    assert checksum(mirror) == checksum(piece)


def test_a_piece_goes_whole_without_a_last_copy_and_a_mask_pays_until_fifteen_sixteenths_change():
    piece = torch.arange(8, dtype=torch.float32)
    entry, tensors = encode(piece, None)
    assert entry[0] == DENSE and tensors[0] is piece
    n = 1 << 12  # bfloat16: a mask costs n/8 + 2k bytes against 2n whole: fewer below k = 15n/16
    assert encoded_bytes(MASK, n, 2, 15 * n // 16 - 1, n) < encoded_bytes(DENSE, n, 2, 0, 0)
    assert encoded_bytes(MASK, n, 2, 15 * n // 16, n) == encoded_bytes(DENSE, n, 2, 0, 0)


def test_masks_and_runs_invert():
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 8, 9, 100):
        mask = torch.rand(n, generator=gen) < 0.4
        assert torch.equal(unpack_mask(pack_mask(mask), n), mask)
        starts, lengths = runs_of(mask)
        assert run_indices(starts, lengths).tolist() == torch.nonzero(mask).view(-1).tolist()


def test_the_checksum_sees_bits_and_order():
    t = torch.tensor([1.0, 2.0, 3.0, -0.0], dtype=torch.float32)
    assert checksum(t) == checksum(t.clone())
    assert checksum(t) != checksum(t.flip(0))  # the same elements elsewhere
    z = t.clone()
    z[3] = 0.0
    assert checksum(t) != checksum(z)
