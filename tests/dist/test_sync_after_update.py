"""After a real optimizer step on the megatron actor, the weight sync makes vLLM sample from the actor's distribution.

TP2 and PP2 on a dense model, EP2 on an MoE model: one PPO update, export -> engine (bucketed, checksum-verified),
then the engine samples continuations of prompts longer than one KV block (128 tokens on CPU) and its logprobs of
the sampled tokens must equal the updated actor's within 1e-4.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model, sample_tokens

PROMPT_LEN, RESPONSE_LEN = 150, 12


def update_then_sync(hf_dir, tp, pp, ep):
    import torch.distributed as dist

    from megarl.config.schema import OptimConfig, RolloutConfig
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLossSettings, make_policy_loss_fn
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from megarl.rollout.process import EngineProcess
    from megarl.bridge.exporter import export_hf_weights

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep), seed=0)
    model, spec = build_and_load(hf_dir)
    trainable = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=1)
    tokens, _ = sample_tokens(4, 24, vocab_size=spec.vocab_size, seed=1, min_len=24)
    g = torch.Generator().manual_seed(2)
    batch = {"input_ids": tokens, "response_mask": torch.ones(4, 23, dtype=torch.bool),
             "old_log_probs": torch.zeros(4, 23) - 5.0, "advantages": torch.randn(4, 23, generator=g)}
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = {k: v[dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp] for k, v in batch.items()}
    micro = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(mine["input_ids"].shape[0])]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    train_mini_batch(trainable, micro, make_policy_loss_fn(settings, loss_denominator(
        [m["response_mask"] for m in micro], "token-mean")))

    engine = None
    if dist.get_rank() == 0:
        cfg = RolloutConfig(n=2, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, ignore_eos=True,
                            load_format="dummy", update_weights_bucket_megabytes=1)
        engine = EngineProcess(cfg, hf_dir, seed=0)
    buckets = export_hf_weights(trainable.chunks, spec, 64 << 10)  # small buckets: tensors split across many
    sync = None
    if engine:
        sync = engine.update_weights(buckets, verify=True)
    else:
        for _ in buckets:  # the export is collective: every rank drains it
            pass
    prompts = sample_tokens(2, PROMPT_LEN, vocab_size=spec.vocab_size, seed=3, min_len=PROMPT_LEN)[0].tolist()
    rollout = engine.generate(prompts) if engine else None
    rollout = [rollout]
    dist.broadcast_object_list(rollout, src=0)
    rollout = rollout[0]
    seqs = torch.tensor([p + rollout.response(i) for i, p in enumerate(rollout.prompt_ids)])
    actor = token_logprobs(trainable.chunks, seqs, micro_batch_size=1)
    if engine:
        engine.shutdown()
    if actor is None or ps.get_tensor_model_parallel_rank() != 0:
        return None
    actor_resp = actor[:, PROMPT_LEN - 1:]  # logprobs of the sampled tokens
    return {"diff": (actor_resp - rollout.rollout_logprobs).abs().max().item(), "sync": sync,
            "moved": rollout.rollout_logprobs.abs().mean().item()}


@pytest.mark.parametrize("arch,tp,pp,ep", [("qwen2", 2, 1, 1), ("llama", 1, 2, 1), ("qwen3_moe", 1, 1, 2)],
                         ids=["tp2-dense", "pp2-dense", "ep2-moe"])
def test_engine_logprobs_equal_actor_after_update(tmp_path, arch, tp, pp, ep):
    hf_dir = make_tiny_model(arch, tmp_path / arch)
    results = [r for r in run_ranks(f"{__name__}:update_then_sync", tp * pp * ep,
                                    {"hf_dir": str(hf_dir), "tp": tp, "pp": pp, "ep": ep}, timeout=600) if r]
    assert results
    for r in results:
        assert r["diff"] < 1e-4, r
