"""validate reads the recipe's model as one ArchSpec (megarl.bridge.checks.model_spec): for a tiny model, the spec it
reads before megarl makes the model (from model.create_tiny) is the one it reads afterwards from the config.json that
megarl.prepare wrote, every field, the tokenizer's vocabulary size included."""
import pytest

from megarl.bridge.checks import model_spec
from megarl.config import load_unchecked
from megarl.prepare import create_tiny_model

MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe")
CASES = [(arch, "arithmetic") for arch in ("llama", "qwen2", "qwen3", "mistral", *MOE)] + [("qwen3", "multiply_tool"),
                                                                                           ("llama", "chain")]


@pytest.mark.parametrize("arch,task", CASES)
def test_a_tiny_models_spec_is_the_same_before_and_after_megarl_makes_it(tmp_path, arch, task):
    model = tmp_path / "model"
    cfg = load_unchecked(data={
        "model": {"path": str(model), "create_tiny": {"architecture": arch, "num_experts": 4 if arch in MOE else 0}},
        "data": {"synthetic": {"task": task, "max_operand": {"multiply_tool": 40, "chain": 20}.get(task, 30)}}})
    before, source = model_spec(cfg)
    assert source == "model.create_tiny"
    syn = cfg.data.synthetic
    create_tiny_model(cfg.model.create_tiny, model, seed=0, max_operand=syn.max_operand, task=syn.task)
    after, source = model_spec(cfg)
    assert source == str(model / "config.json")
    assert before == after


def test_no_spec_where_the_model_is_unknown_or_the_bridge_cannot_read_it(tmp_path):
    """The layout rules then stay silent: check_paths and check_architecture say what is wrong."""
    assert model_spec(load_unchecked(data={"model": {"path": str(tmp_path / "absent")}})) is None
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_head": 12}')
    cfg = load_unchecked(data={"model": {"path": str(tmp_path / "absent"),
                                         "config_path": str(tmp_path / "config.json")}})
    assert model_spec(cfg) is None


def test_tiny_head_sizes_that_make_no_config_are_one_report_each_not_a_traceback(tmp_path):
    from megarl.bridge.checks import check_architecture

    cfg = load_unchecked(data={"model": {"path": str(tmp_path / "model"), "create_tiny": {
        "hidden_size": 128, "num_attention_heads": 12, "num_key_value_heads": 5}}})
    assert model_spec(cfg) is None  # the layout rules stay silent instead of building transformers' config
    issues = {i.key: i for i in check_architecture(cfg)}
    assert set(issues) == {"model.create_tiny.hidden_size", "model.create_tiny.num_key_value_heads"}
    # 128 / 12 is not whole; the suggestion keeps head_dim >= 32 (vLLM's CPU attention): 12 * 32
    assert "hidden_size=384" in issues["model.create_tiny.hidden_size"].fix
    assert "[1, 2, 3, 4, 6, 12]" in issues["model.create_tiny.num_key_value_heads"].fix
    ok = load_unchecked(data={"model": {"path": str(tmp_path / "model"), "create_tiny": {
        "hidden_size": 384, "num_attention_heads": 12, "num_key_value_heads": 4}}})
    assert check_architecture(ok) == [] and model_spec(ok) is not None
