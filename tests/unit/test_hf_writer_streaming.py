"""StreamingHFWriter: planned shards, tensor-by-tensor writes, completeness checks before the index."""
import json

import pytest
import torch

from megarl.checkpoint.hf_writer import StreamingHFWriter, parse_size


def _plan():
    return [("a.weight", (4, 8), torch.float32), ("b.weight", (16,), torch.bfloat16), ("c.weight", (3, 5), torch.float32)]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("200KB") == 200_000 and parse_size(7) == 7
    assert parse_size("1MiB") == 1 << 20 and parse_size("123") == 123


def test_writes_shards_and_index_loadable_by_safetensors(tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"a": 1}')
    (src / "tokenizer.json").write_text("{}")
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g).to(d) for n, s, d in _plan()}
    seen = []
    w = StreamingHFWriter(tmp_path / "out", _plan(), max_shard_bytes=140, on_bytes=seen.append)
    for name, t in tensors.items():
        w.write(name, t)
    out = w.finish(src, config={"b": 2})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["metadata"]["total_size"] == sum(seen) == 4 * 8 * 4 + 16 * 2 + 15 * 4
    loaded = {}
    for f in files:
        loaded.update(load_file(str(out / f)))
    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[n], tensors[n]) and loaded[n].dtype == tensors[n].dtype for n in tensors)
    assert json.loads((out / "config.json").read_text()) == {"b": 2} and (out / "tokenizer.json").is_file()
    assert not (tmp_path / "out.tmp").exists()


def test_refuses_wrong_order_shape_and_incomplete(tmp_path):
    w = StreamingHFWriter(tmp_path / "out", _plan())
    with pytest.raises(ValueError, match="out of order"):
        w.write("b.weight", torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="planned"):
        w.write("a.weight", torch.zeros(4, 9))
    w.write("a.weight", torch.zeros(4, 8))
    with pytest.raises(ValueError, match="never written"):
        w.finish()
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_background_writes_give_the_same_files(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {n: torch.randn(s, generator=g).to(d) for n, s, d in _plan()}
    outs = []
    for name, pending in (("sync", 0), ("background", 64)):  # 64 bytes: the queue holds about one tensor
        w = StreamingHFWriter(tmp_path / name, _plan(), max_shard_bytes=140, pending_bytes=pending)
        for n, t in tensors.items():
            w.write(n, t)
        outs.append(w.finish())
    for f in sorted(p.name for p in outs[0].iterdir()):
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), f


def test_background_write_failure_reaches_the_caller(tmp_path):
    w = StreamingHFWriter(tmp_path / "out", _plan(), pending_bytes=1 << 20)
    w.write("a.weight", torch.zeros(4, 8))
    w.wait_for_room(1 << 20)  # nothing pending: a.weight is written and the shard file is open
    w._fh.close()  # the writer thread's next write fails
    with pytest.raises(ValueError, match="closed file"):
        try:
            w.write("b.weight", torch.zeros(16, dtype=torch.bfloat16))
            w.write("c.weight", torch.zeros(3, 5))
            w.finish()
        except BaseException:
            w.abort()
            raise
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
