"""megarl.sync.delta: the changed elements of a piece, by bits, sent as (indices, values) when that is fewer bytes."""
import torch

from megarl.sync.delta import DENSE, apply_sparse, changed_indices, checksum, encode, sparse_bytes


def test_changes_are_found_by_bits_and_applied_exactly():
    last = torch.tensor([[1.0, -0.0, float("nan")], [2.0, 3.0, 4.0]] * 4, dtype=torch.bfloat16)
    piece = last.clone()
    piece[0, 1] = 0.0  # -0.0 -> 0.0: equal as values, other bits
    piece[5, 2] = 4.03125  # the next bfloat16 after 4.0
    assert changed_indices(piece, last).tolist() == [1, 17]
    entry, tensors = encode(piece, last)  # 2 x (4 + 2) bytes < 24 x 2 bytes
    assert entry == 2 and tensors[0].dtype == torch.int32 and tensors[1].dtype == torch.bfloat16
    mirror = last.clone()
    apply_sparse(mirror, *tensors)
    assert torch.equal(mirror.view(torch.int16), piece.view(torch.int16))
    assert sparse_bytes(entry, piece) == 12


def test_a_piece_goes_whole_without_a_last_copy_or_when_most_of_it_changed():
    piece = torch.arange(8, dtype=torch.float32)
    assert encode(piece, None)[0] == DENSE
    last = piece.clone()
    last[:4] += 1  # 4 x (4 + 4) bytes = the piece's 32 bytes: whole is no more
    entry, tensors = encode(piece, last)
    assert entry == DENSE and tensors[0] is piece
    assert encode(piece, piece.clone()) == (0, [])


def test_the_checksum_sees_bits_and_order():
    t = torch.tensor([1.0, 2.0, 3.0, -0.0], dtype=torch.float32)
    assert checksum(t) == checksum(t.clone())
    assert checksum(t) != checksum(t.flip(0))  # the same elements elsewhere
    z = t.clone()
    z[3] = 0.0
    assert checksum(t) != checksum(z)
