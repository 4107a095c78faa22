"""On a GPU every tensor given to the model or to a collective must be on the rank's CUDA device (NCCL takes no CPU
tensor). A CPU machine cannot run NCCL, so these tests declare the runtime's device to be 'meta', a device no tensor
reaches by accident, and put recorders in place of the model and of torch.distributed's collectives: a micro-batch or
a collective buffer left on the CPU shows up as a 'cpu' tensor in the recording (and megarl's own guard,
distributed.check_device, rejects it before that)."""
import pytest
import torch
import torch.distributed as dist

from megarl import distributed
from megarl.megatron import train_step


class _Reached(Exception):
    """Raised by a recorder to stop a function after its last collective (meta tensors hold no values to read)."""


@pytest.fixture
def recorded(monkeypatch):
    """Declares 'meta'; returns the list of (collective, device types of its tensors) calls."""
    calls = []

    def recorder(name, stop=False):
        def collective(*args, **kwargs):
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            calls.append((name, {t.device.type for t in tensors}))
            if stop:
                raise _Reached(name)
        return collective

    monkeypatch.setattr(dist, "all_reduce", recorder("all_reduce"))
    monkeypatch.setattr(dist, "broadcast", recorder("broadcast"))
    monkeypatch.setattr(dist, "all_gather", recorder("all_gather"))
    monkeypatch.setattr(train_step, "_dp_group", lambda: None)
    distributed.declare_device("meta")
    yield calls, monkeypatch, recorder
    distributed.declare_device(None)


def _layout(monkeypatch, pp: int, dp: int):
    from megatron.core import parallel_state as ps

    for name, value in (("get_pipeline_model_parallel_world_size", pp), ("get_pipeline_model_parallel_last_rank", 0),
                        ("get_data_parallel_world_size", dp), ("get_pipeline_model_parallel_group", None),
                        ("get_data_parallel_group", None), ("is_pipeline_last_stage", True)):
        monkeypatch.setattr(ps, name, lambda *a, value=value, **k: value)


class _RecordingModel(torch.nn.Module):
    """Stands in for a GPTModel: records its inputs' devices and returns logits on the input's device."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        # a packed micro-batch's boundaries stay on the host without TE (megarl.megatron.packing.seq_params)
        inputs = [input_ids, position_ids] + ([attention_mask] if attention_mask is not None else [])
        self.devices.append({t.device.type for t in inputs})
        return torch.zeros(*input_ids.shape, 16, device=input_ids.device)


def _micro_batch():  # as the trainer builds it: on the CPU
    return {"input_ids": torch.randint(0, 16, (2, 6)), "response_mask": torch.ones(2, 5), "step": 3}


def test_forward_step_gives_the_model_and_the_loss_tensors_on_the_runtime_device(recorded):
    model = _RecordingModel()
    seen = {}

    def loss_fn(mb, output):
        seen.update({k: v.device.type for k, v in mb.items() if isinstance(v, torch.Tensor)}, output=output.device.type)
        return (output.sum() * mb["response_mask"].sum()), {"n": mb["response_mask"].sum()}

    output, loss_func = train_step.forward_step(loss_fn, 4.0, iter([_micro_batch()]), model)
    assert model.devices == [{"meta"}]
    loss, metrics = loss_func(output)
    assert seen == {"input_ids": "meta", "response_mask": "meta", "output": "meta"}
    assert loss.device.type == "meta" and metrics["n"].device.type == "meta"


def test_the_guard_rejects_a_cpu_tensor_for_the_model_and_for_collectives(recorded):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(distributed.DeviceMismatch, match=r"model input: a \(1, 4\) torch.int64 tensor is on cpu, the "
                                                       r"runtime computes on meta"):
        distributed.call_model(_RecordingModel(), ids, ids, ids)
    with pytest.raises(distributed.DeviceMismatch, match="all_reduce"):
        distributed.all_reduce(torch.zeros(2))
    calls, _, _ = recorded
    assert calls == []


def test_loss_denominator_is_reduced_on_the_runtime_device(recorded):
    calls, _, _ = recorded
    total = train_step.loss_denominator([torch.ones(2, 5), torch.ones(1, 5)], "token-mean")
    assert total.device.type == "meta" and total.dtype == torch.float64
    assert calls == [("all_reduce", {"meta"})]


def test_metrics_are_reduced_on_the_runtime_device(recorded):
    calls, monkeypatch, recorder = recorded
    _layout(monkeypatch, pp=1, dp=2)
    monkeypatch.setattr(dist, "all_reduce", recorder("all_reduce", stop=True))
    results = [{"pg_loss": torch.tensor(0.5), "clip_frac": torch.tensor(0.1)} for _ in range(2)]  # metrics on the CPU
    with pytest.raises(_Reached):
        train_step._reduce_metrics(results, n_micro=2)
    assert calls == [("all_reduce", {"meta"})]


def test_gathered_output_travels_on_the_runtime_device(recorded):
    """A first pipeline stage has no output: it receives the last stage's in a buffer that must be on the device."""
    calls, monkeypatch, recorder = recorded
    _layout(monkeypatch, pp=2, dp=2)
    monkeypatch.setattr(dist, "all_gather", recorder("all_gather", stop=True))
    with pytest.raises(_Reached):
        distributed.gather_model_output(None, (3, 5))
    assert calls == [("broadcast", {"meta"}), ("all_gather", {"meta"})]


def test_compute_device_is_the_one_decision():
    assert distributed.compute_device() == distributed.device()
    distributed.declare_device("meta")
    try:
        assert distributed.compute_device() == torch.device("meta")
        assert distributed.to_device(_micro_batch())["input_ids"].device.type == "meta"
    finally:
        distributed.declare_device(None)
    assert distributed.compute_device() == distributed.device()
