"""megarl.sync.transports.remote_delta: which hosts get an update whole, the kept copy brought up to date in place
(one copy of what a rank sends, never a second), and the read-back schedule of the engine workers."""
import torch

from megarl.sync.delta import DENSE, SAME, apply, payload
from megarl.sync.transports.remote_delta import DeltaSender, DeltaSettings


def test_whole_updates_per_host_first_periodic_and_after_a_restart():
    sender = DeltaSender(DeltaSettings(full_every=3), [2, 3], ["a"])
    seen = [sender.full_hosts() for _ in range(4)]
    assert seen == [{2, 3}, set(), set(), {2, 3}]  # the first, then every third update of each host
    sender.mark_fresh([3])  # host 3 restarted: its next update is whole, host 2 keeps its own count
    assert [sender.full_hosts() for _ in range(4)] == [{3}, set(), {2}, {3}]


def test_the_kept_copy_is_one_tensor_brought_to_each_piece_in_place():
    sender = DeltaSender(DeltaSettings(), [2], ["a"])
    piece = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    mirror = torch.empty_like(piece)
    entry, tensors = sender.encode((0, 0), piece, full=True)
    apply(mirror, entry, tensors)
    kept = sender.kept[(0, 0)]
    assert entry[0] == DENSE and kept.data_ptr() != piece.data_ptr()  # a copy: the parameter changes in place
    for step in range(3):
        piece = piece.clone()
        piece[step * 100:(step * 100) + 5] += 1  # a few elements move
        entry, tensors = sender.encode((0, 0), piece, full=False)
        received = [t.clone().reshape(-1) for t in tensors]
        assert [(t.numel(), t.dtype) for t in received] == payload(entry, piece.numel(), piece.dtype)
        apply(mirror, entry, received)
        assert sender.kept[(0, 0)] is kept  # the same storage: no second copy per update
        assert torch.equal(kept.view(torch.int16), piece.view(torch.int16))
        assert torch.equal(mirror.view(torch.int16), piece.view(torch.int16))
    assert sender.encode((0, 0), piece, full=False)[0][0] == SAME


def test_workers_read_back_a_few_tensors_in_turn_and_all_of_them_every_n_updates():
    names = [f"w{i}" for i in range(5)]
    sender = DeltaSender(DeltaSettings(verify_every=4, verify_sample=2), [2], names)
    checks = [sender.worker_check(sync, verify=False) for sync in range(1, 9)]
    assert checks[3] is True and checks[7] is True  # updates 4 and 8: every tensor
    sampled = [c for c in checks if c is not True]
    assert all(len(c) == 2 for c in sampled)
    assert set(sum(sampled[:3], [])) == set(names)  # in turn: every name within ceil(5 / 2) sampled updates
    assert sender.worker_check(1, verify=True) is True  # run(verify=True) asks for all of them
    off = DeltaSender(DeltaSettings(verify_every=0, verify_sample=0), [2], names)
    assert off.worker_check(10, verify=False) is False


def test_after_a_delta_that_did_not_pay_the_next_update_goes_whole():
    """Every element changed: each piece goes DENSE anyway and the header entries make the delta larger than a whole
    update; the ranks' byte counts (their reports, gathered) send the next update whole, and the one after tries
    again."""
    sender = DeltaSender(DeltaSettings(full_every=100), [2], ["a"])
    piece = torch.arange(64, dtype=torch.float32)

    def update(shift):
        full = sender.full_hosts()
        entry, _ = sender.encode((0, 0), piece + shift, 2 in full, 2)
        sender.check(1, [sender.report([], 0, 0)], [[{"sums": {}}]])  # one trainer rank, no piece to compare
        return full, entry[0]

    assert update(0) == ({2}, DENSE)  # the first: whole
    assert update(1) == (set(), DENSE)  # a delta update, every element changed: 64 x 4 bytes + a 24-byte header
    assert sender.unpaid == {2}
    assert update(2) == ({2}, DENSE)  # whole, no diff computed
    assert update(2) == (set(), SAME)  # tried again: nothing changed, a delta pays
    assert sender.unpaid == set()
