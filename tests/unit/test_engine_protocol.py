"""Every engine the trainer can hold implements the whole RolloutEngine interface (checked on the classes)."""
import pytest

from megarl.rollout.protocol import RolloutEngine
from megarl.sync.seam import TransferTarget, UpdateTarget, missing_members


def test_protocol_lists_the_trainer_calls():
    class Nothing:
        pass

    members = set(missing_members(Nothing, RolloutEngine))
    assert {"generate", "abort", "begin_update", "load_bucket", "end_update", "abort_update", "layouts",
            "weight_version", "sleep", "wake_up", "sleeps", "shutdown"} <= members


def test_the_sync_seam_is_narrow():
    """The sync asks an engine for its workers' layouts, in-place targets, and an update to open, feed and close."""
    class Nothing:
        pass

    assert set(missing_members(Nothing, UpdateTarget)) == {"layouts", "place_weights", "begin_update", "load_bucket",
                                                           "end_update", "abort_update"}


@pytest.mark.parametrize("where", ["megarl.rollout.vllm.engine:VLLMEngine", "megarl.rollout.hosting.process:EngineProcess",
                                   "megarl.rollout.hf.engine:HFEngine"])
def test_engine_implements_the_protocol(where):
    import importlib

    module, name = where.split(":")
    assert missing_members(getattr(importlib.import_module(module), name), RolloutEngine) == []


@pytest.mark.parametrize("where", ["megarl.rollout.hosting.process:EngineProcess", "megarl.rollout.hosting.ray:RayEngine"])
def test_engine_hosts_implement_the_transfer_protocol(where):
    import importlib

    module, name = where.split(":")
    assert missing_members(getattr(importlib.import_module(module), name), TransferTarget) == []


def test_missing_member_is_named():
    class Half:
        def generate(self, prompt_token_ids):
            return None

    assert "abort" in missing_members(Half, RolloutEngine) and "generate" not in missing_members(Half, RolloutEngine)
