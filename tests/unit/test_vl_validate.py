"""`megarl validate` on a vision-language policy: what trains now (the hf engine, colocated, sync mode, TP, no
critic) passes; each setting that takes no images yet is refused in one line naming the key, its value, the rule and
the fix, before anything starts."""
import json

import pytest
from PIL import Image

from megarl.config.issues import ConfigError
from megarl.validate import load_config

RECIPE = "recipes/grpo_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.helpers.tiny_vlm import make_tiny_vl_model

    tmp = tmp_path_factory.mktemp("vl_validate")
    model = make_tiny_vl_model(tmp / "vl_model")
    Image.new("RGB", (56, 56), (200, 20, 20)).save(tmp / "red.png")
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "<image>What colour?"}],
                                "images": ["red.png"], "data_source": "exact_match", "response": "red",
                                "reward_model": {"ground_truth": "red"}}) + "\n")
    base = ["sft.enable=false", "data.val_files=[]",
            f"data.train_files=[{data}]", f"model.path={model}", "model.create_tiny=null"]
    return base


def test_a_vl_policy_trains_with_the_hf_engine(setup):
    cfg = load_config(RECIPE, setup + ["rollout.name=hf", "parallelism.tensor_model_parallel_size=2",
                                       "trainer.n_gpus_per_node=2"])
    assert cfg.rollout.name == "hf"


def test_a_vl_policy_takes_the_sft_warm_start(setup):
    data = next(o.split("=", 1)[1] for o in setup if o.startswith("data.train_files="))
    cfg = load_config(RECIPE, setup + ["rollout.name=hf", "sft.enable=true", f"sft.train_files={data}"])
    assert cfg.sft.enable


@pytest.mark.parametrize("overrides,key", [
    ([], "rollout.name"),  # the recipe's vLLM engine
    (["rollout.name=hf", "parallelism.context_parallel_size=2", "trainer.n_gpus_per_node=2"],
     "parallelism.context_parallel_size"),
    (["rollout.name=hf", "algorithm.adv_estimator=gae"], "critic.enable"),
    (["rollout.name=hf", "trainer.mode=one_step_off_policy"], "trainer.mode"),
    (["rollout.name=hf", "actor.lora.rank=4"], "actor.lora.rank"),
])
def test_what_takes_no_images_yet_is_refused_in_one_line(setup, overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, setup + overrides)
    lines = [line for line in str(e.value).splitlines() if "vision-language model" in line]
    assert len(lines) == 1 and key in lines[0] and "->" in lines[0] and "Traceback" not in str(e.value), str(e.value)
    print(lines[0].strip())
