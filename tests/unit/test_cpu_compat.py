"""The CPU compatibility layer matches the installed megatron-core, and fails loudly when it no longer does."""
import pytest

from megarl.megatron import cpu_compat


def test_every_patched_symbol_exists_in_the_installed_megatron():
    assert cpu_compat.missing_symbols() == []


def test_a_moved_symbol_is_reported_by_name_with_the_fix(monkeypatch):
    broken = cpu_compat._Patch("fake", "why", ("megatron.core.tensor_parallel.random:no_such_function",), lambda: None)
    monkeypatch.setattr(cpu_compat, "PATCHES", cpu_compat.PATCHES + (broken,))
    monkeypatch.setattr(cpu_compat, "_applied", [])
    with pytest.raises(cpu_compat.MegatronCompatError) as err:
        cpu_compat.apply(force=True)
    msg = str(err.value)
    assert "megatron.core.tensor_parallel.random:no_such_function" in msg
    assert cpu_compat.TESTED_MEGATRON_VERSION in msg and "pip install megatron-core==" in msg
