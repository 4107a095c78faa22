"""Placed weight writes (megarl.sync.placement) on hand-written loaders shaped like vLLM's: where a probe finds each
HF tensor lands must be where the loader itself, run for real, puts it."""
import os

import pytest
import torch

from megarl.sync import placement
from megarl.sync.boxes import full_box, relative_slices

HIDDEN, HEAD = 8, 2
VOCAB, PADDED = 13, 16


class Fused(torch.nn.Module):
    """A rank's shard of fused q/k/v (rows of q, then of k, then of v), an embedding with a padded vocabulary, a
    norm, and a head tied to the embedding; `load_weights` works as vLLM's loaders do: narrow the full HF tensor to
    this rank's rows, copy into a slice of the fused parameter; zero the padding rows."""

    def __init__(self, rank: int, tp: int):
        super().__init__()
        self.rank, self.tp = rank, tp
        self.qkv = torch.nn.Parameter(torch.randn(3 * HIDDEN // tp, HIDDEN), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.randn(PADDED, HIDDEN), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.randn(HIDDEN), requires_grad=False)
        self.head = self.embed  # tied

    def load_weights(self, weights):
        rows = HIDDEN // self.tp
        for name, w in weights:
            if name in ("q", "k", "v"):
                part = "qkv".index(name)
                self.qkv.data.narrow(0, part * rows, rows).copy_(w.narrow(0, self.rank * rows, rows))
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0]:].fill_(0)
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "converted":
                self.norm.data.copy_(w.to(torch.float64).to(torch.float32))
            elif name == "scaled":
                self.norm.data.copy_(w)
                self.norm.data.mul_(2)


def needs_of(rank: int, tp: int) -> dict:
    rows = HIDDEN // tp
    need = [[rank * rows, (rank + 1) * rows], [0, HIDDEN]]
    out = {n: ("float32", [HIDDEN, HIDDEN], need) for n in "qkv"}
    out["embed"] = ("float32", [VOCAB, HIDDEN], [[0, VOCAB], [0, HIDDEN]])
    out["norm"] = ("float32", [HIDDEN], [[0, HIDDEN]])
    return out


def hf_tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(HIDDEN, HIDDEN, generator=g) for n in "qkv"}
    out["embed"] = torch.randn(VOCAB, HIDDEN, generator=g)
    out["norm"] = torch.randn(HIDDEN, generator=g)
    return out


@pytest.fixture
def arena_path(tmp_path):
    return str(tmp_path / "arena")


def test_source_box_of_views():
    full = torch.empty(6, 4)
    assert placement.source_box(full.narrow(0, 2, 3), full) == ((2, 5), (0, 4))
    assert placement.source_box(full[1:3, 1:4], full) == ((1, 3), (1, 4))
    assert placement.source_box(full, full) == ((0, 6), (0, 4))
    assert placement.source_box(full.t(), full) is None  # transposed: not a box
    assert placement.source_box(full.view(4, 6), full) is None  # same storage, another shape
    assert placement.source_box(full.reshape(24), full) is None  # fewer dims
    assert placement.source_box(full[::2], full) is None  # strided rows
    assert placement.source_box(torch.empty(6, 4), full) is None  # another tensor


def test_share_parameters_keeps_values_and_ties(arena_path):
    model = Fused(0, 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    arena = placement.share_parameters(list(model.parameters()), arena_path)
    assert os.path.getsize(arena_path) == arena.numel() and arena.numel() % 64 == 0
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr(), name
        assert torch.equal(p, before[name]), name
    assert model.head is model.embed
    # the file is the parameters: a write through a second mapping of it is seen by the model
    other = torch.from_file(arena_path, shared=True, size=arena.numel(), dtype=torch.uint8)
    other.zero_()
    assert float(model.qkv.abs().sum()) == 0.0


@pytest.mark.parametrize("rank,tp", [(0, 1), (1, 2)])
def test_placed_writes_equal_the_loader(arena_path, rank, tp):
    placed_model, loaded_model = Fused(rank, tp), Fused(rank, tp)
    arena = placement.share_parameters(list(placed_model.parameters()), arena_path)
    untouched = arena.clone()
    records, refused = placement.probe_placements(placed_model.load_weights, [arena], needs_of(rank, tp))
    assert refused == {} and set(records) == {"q", "k", "v", "embed", "norm"}
    # the probe wrote nothing but the padding rows' zeros
    changed = (arena != untouched).nonzero().flatten()
    pad = placed_model.embed[VOCAB:]
    pad_start = pad.storage_offset() * 4
    assert changed.numel() == 0 or (changed.min() >= pad_start and changed.max() < pad_start + pad.numel() * 4)
    assert float(placed_model.embed[VOCAB:].abs().sum()) == 0.0

    weights = hf_tensors(seed=3)
    views = placement.region_viewer([torch.from_file(arena_path, shared=True, size=arena.numel(), dtype=torch.uint8)])
    for name, (_, shape, need) in needs_of(rank, tp).items():
        need = tuple(tuple(b) for b in need)
        rows = need[0]
        # the shard arrives in two pieces (as from two trainer ranks or two buckets)
        mid = (rows[0] + rows[1]) // 2
        for box in ((rows[:1] + (mid,),) + need[1:], ((mid, rows[1]),) + need[1:]):
            piece = weights[name][relative_slices(box, full_box(shape))]
            placement.write_placed(views, records[name], box, piece)
    loaded_model.load_weights(list(weights.items()))
    for name, p in loaded_model.named_parameters():
        assert torch.equal(getattr(placed_model, name), p), name


def test_loaders_that_transform_the_data_are_refused(arena_path):
    model = Fused(0, 1)
    arena = placement.share_parameters(list(model.parameters()), arena_path)
    norm = model.norm.detach().clone()
    needs = {"converted": ("float32", [HIDDEN], [[0, HIDDEN]]), "scaled": ("float32", [HIDDEN], [[0, HIDDEN]])}
    records, refused = placement.probe_placements(model.load_weights, [arena], needs)
    assert records == {}
    assert "converted or reshaped" in refused["converted"] and "mul_" in refused["scaled"]
    assert torch.equal(model.norm, norm)  # the probe changed nothing


def test_a_loader_that_reads_less_than_planned_is_refused(arena_path):
    model = Fused(0, 2)  # reads rows 0-4 of q
    arena = placement.share_parameters(list(model.parameters()), arena_path)
    needs = {"q": ("float32", [HIDDEN, HIDDEN], [[0, HIDDEN], [0, HIDDEN]])}  # a plan that expects all rows
    records, refused = placement.probe_placements(model.load_weights, [arena], needs)
    assert records == {} and "less than the planned box" in refused["q"]


def test_a_full_shared_memory_folder_fails_before_anything_moved(arena_path, monkeypatch):
    import errno

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    model = Fused(0, 1)
    storage = model.qkv.untyped_storage().data_ptr()
    with pytest.raises(OSError, match="cannot reserve .* bytes for the engine's weights"):
        placement.share_parameters(list(model.parameters()), arena_path)
    assert not os.path.exists(arena_path)
    assert model.qkv.untyped_storage().data_ptr() == storage  # the parameters stay where they were
