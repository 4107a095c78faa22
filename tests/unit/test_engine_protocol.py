"""Every engine the trainer can hold implements the whole RolloutEngine interface (checked on the classes)."""
import pytest

from megarl.rollout.protocol import RolloutEngine, missing_members


def test_protocol_lists_the_trainer_calls():
    members = {m for m in vars(RolloutEngine) if not m.startswith("_")}
    assert {"generate", "abort", "begin_update", "load_bucket", "end_update", "abort_update", "layouts",
            "weight_version", "sleep", "wake_up", "sleeps", "shutdown"} <= members


@pytest.mark.parametrize("where", ["megarl.rollout.engine:VLLMEngine", "megarl.rollout.process:EngineProcess"])
def test_engine_implements_the_protocol(where):
    import importlib

    module, name = where.split(":")
    assert missing_members(getattr(importlib.import_module(module), name)) == []


@pytest.mark.parametrize("where", ["megarl.rollout.process:EngineProcess", "megarl.rollout.ray_engine:RayEngine"])
def test_engine_hosts_implement_the_transfer_protocol(where):
    import importlib

    from megarl.rollout.protocol import EngineHosts

    module, name = where.split(":")
    assert missing_members(getattr(importlib.import_module(module), name), EngineHosts) == []


def test_missing_member_is_named():
    class Half:
        def generate(self, prompt_token_ids):
            return None

    assert "abort" in missing_members(Half) and "generate" not in missing_members(Half)
