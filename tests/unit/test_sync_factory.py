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
