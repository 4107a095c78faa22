"""The weight sync's factory (megarl.sync.factory): which transport a recipe picks, and that it refuses what it
cannot build before any collective runs."""
import pytest

from megarl.config.schema import MegarlConfig
from megarl.sync.factory import ADAPTER, COLOCATED, REMOTE, SyncFactory, transport_of


@pytest.mark.parametrize("data,want", [
    ({}, COLOCATED),
    ({"rollout": {"placement": "separate"}}, REMOTE),
    ({"rollout": {"mode": "ray"}}, REMOTE),  # Ray actors are always placed apart from the trainer
    ({"actor": {"lora": {"rank": 8, "sync": "adapter"}}}, ADAPTER),
    ({"actor": {"lora": {"rank": 8, "sync": "adapter"}}, "rollout": {"placement": "separate"}}, ADAPTER),
    ({"actor": {"lora": {"rank": 8, "sync": "merged"}}}, COLOCATED),  # merged adapters travel as whole weights
])
def test_the_recipe_picks_the_transport(data, want):
    assert transport_of(MegarlConfig.model_validate(data)) == want


def test_unknown_transport_and_adapters_without_a_dtype_are_refused_before_building_anything():
    factory = SyncFactory(chunks=None, spec=None)  # holdings would fail to build from these: nothing may try
    with pytest.raises(ValueError, match="transport 'nccl'"):
        factory.build("nccl", None, None, 1 << 20)
    with pytest.raises(ValueError, match="engine's dtype"):
        factory.build(ADAPTER, None, None, 1 << 20)
    assert factory._holdings is None


@pytest.mark.parametrize("data,want", [
    ({}, (COLOCATED, 512 << 20, None, False, None)),  # defaults on CPU: a float32 engine, delta updates off
    ({"rollout": {"placement": "separate", "delta_updates": True, "delta_full_every": 4,
                  "update_weights_bucket_megabytes": 64}}, (REMOTE, 64 << 20, "float32", False, 4)),
    ({"rollout": {"placement": "separate", "dtype": "bfloat16"}}, (REMOTE, 512 << 20, "bfloat16", False, 10)),
    ({"rollout": {"placement": "separate", "delta_updates": False, "dtype": "bfloat16"}},
     (REMOTE, 512 << 20, "bfloat16", False, None)),
    ({"actor": {"lora": {"rank": 8, "sync": "adapter"}}, "rollout": {"load_format": "dummy"}},
     (ADAPTER, 512 << 20, "float32", True, None)),
])
def test_the_recipe_settings_reach_the_transport(data, want, monkeypatch):
    """for_recipe is the one reader of the recipe's sync settings: transport, bucket size, wire dtype (the engine's,
    float32 for "auto" on CPU), dummy-weight base sync, delta cadence (delta updates unset: on for a 16-bit engine,
    off for a float32 one)."""
    factory = SyncFactory(chunks=None, spec=None)
    seen = []
    monkeypatch.setattr(factory, "build", lambda transport, engine, topology, bucket_bytes, engine_dtype,
                        base_weights=False, delta=None: seen.append(
                            (transport, bucket_bytes, engine_dtype, base_weights,
                             delta.full_every if delta else None)))
    factory.for_recipe(MegarlConfig.model_validate(data), None, None)
    transport, bucket, dtype, base, delta = seen[0]
    assert (transport, bucket, None if dtype is None else str(dtype).replace("torch.", ""), base, delta) == want
