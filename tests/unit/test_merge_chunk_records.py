"""The merger finds a checkpoint chunk's raw bytes by parsing its torch.save record (a zip archive) itself; only plain
contiguous little-endian tensors that fill their storage qualify, anything else goes to torch's reader (None)."""
import io

import pytest
import torch

from megarl.checkpoint.chunk_records import raw_data_offset


def _record_in_file(tmp_path, tensor, lead: bytes = b"x" * 1000, trail: bytes = b"y" * 77):
    """A file holding other bytes, then torch.save(tensor), then other bytes (as a shard file holds many chunks);
    returns (open file, record offset, record length)."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    record = buf.getvalue()
    path = tmp_path / "shard.distcp"
    path.write_bytes(lead + record + trail)
    return open(path, "rb"), len(lead), len(record)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(7, 5), (3, 1, 4), (1, 6), (9,)])
def test_offset_of_a_plain_tensor_holds_its_bytes(tmp_path, dtype, shape):
    t = (torch.arange(int(torch.tensor(shape).prod())) * 3 + 1).to(dtype).reshape(shape)
    f, offset, length = _record_in_file(tmp_path, t)
    at = raw_data_offset(f, offset, length, shape, dtype)
    assert at is not None
    f.seek(at)
    raw = f.read(t.numel() * t.element_size())
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape), t)


def _base():
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)


@pytest.mark.parametrize("what, tensor, chunk, dtype", [
    ("transposed", _base().t(), (6, 4), torch.float32),
    ("a view into a bigger storage", _base()[1:3], (2, 6), torch.float32),
    ("another dtype than the metadata's", _base(), (4, 6), torch.bfloat16),
    ("another shape than the metadata's", _base(), (6, 4), torch.float32),
    ("not a tensor", {"a": 1}, (4, 6), torch.float32),
])
def test_anything_else_is_left_to_torchs_reader(tmp_path, what, tensor, chunk, dtype):
    f, offset, length = _record_in_file(tmp_path, tensor)
    assert raw_data_offset(f, offset, length, chunk, dtype) is None, what


def test_bytes_that_are_not_a_record_are_left_to_torchs_reader(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"PK\x05\x06" + b"\xff" * 300)
    with open(path, "rb") as f:
        assert raw_data_offset(f, 0, 304, (4,), torch.float32) is None
