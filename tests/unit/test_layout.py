"""megarl.layout.Layout: the sizes every part of megarl derives from the parallelism section, by hand."""
import pytest

from megarl.config.schema import ParallelismConfig
from megarl.layout import Layout


def test_sizes_of_a_moe_layout():
    lay = Layout.of(ParallelismConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      context_parallel_size=2, expert_model_parallel_size=4))
    assert lay.model_parallel_size == 8 and lay.expert_tensor == 2 and lay.expert_model_parallel_span == 16
    assert lay.data_parallel_size(64) == 8 and lay.expert_data_parallel_size(64) == 4
    assert lay.fits(64) and not lay.fits(24)  # 24 = 3 copies of TP*PP*CP, but not a whole number of expert spans


def test_a_world_that_does_not_split_names_the_sizes():
    with pytest.raises(ValueError, match=r"TP\*PP\*CP = 2\*2\*1 = 4"):
        Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(6)
