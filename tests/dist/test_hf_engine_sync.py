"""The weight sync into the transformers engine (rollout.name=hf) after a real optimizer step, as
tests/dist/test_sync_after_update.py does for vLLM: trainer TP2 and PP2 on dense models and EP2 on Qwen3-MoE (its
experts fused into transformers' 3-D parameters), a first sync, one PPO update, a second sync in small buckets (the
trainer ranks write every piece straight into the engine's parameters, in the shared-memory arena; checksums verified),
then the engine samples continuations of long prompts and its logprobs of the sampled tokens must equal the updated
actor's within the float32 bound derived from the model's widths, depth and logits (tests/helpers/bounds.py; the
engine's transformers forward and megatron's round differently, the same math). The bytes moved equal the plan's.
"""
import pytest

from megarl.launch_local import run_ranks
from tests.dist.test_sync_after_update import PROMPT_LEN, RESPONSE_LEN, one_policy_step, sampled_bound, sync_and_sample
from tests.helpers.tiny_models import make_tiny_model

pytestmark = [pytest.mark.parity]


def update_then_sync_hf(hf_dir, tp, pp, ep):
    import torch.distributed as dist

    from megarl.config.schema import OptimConfig, RolloutConfig
    from megarl.layout import EngineTopology
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.sync.factory import build_sync

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep), seed=0)
    model, spec = build_and_load(hf_dir)
    trainable = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=1)
    engine = None
    if dist.get_rank() == 0:
        cfg = RolloutConfig(name="hf", n=2, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, ignore_eos=True,
                            load_format="dummy", max_num_seqs=8)
        engine = EngineProcess(cfg, hf_dir, seed=0, name="megarl-hf-engine")
    delivery = build_sync(trainable.chunks, spec, engine, EngineTopology(dist.get_world_size(), 1, 1), 64 << 10)
    first = delivery.run(engine, verify=True)

    one_policy_step(trainable, spec)
    out = sync_and_sample(trainable, spec, "hf", engine, delivery)
    out["first"] = first if dist.get_rank() == 0 else None
    return out


# trainer TP2 in the default suite; PP2 and EP2 (each a launch of its own) with `make test-slow`
CASES = [("qwen2", 2, 1, 1), pytest.param("llama", 1, 2, 1, marks=pytest.mark.slow),
         pytest.param("qwen3_moe", 1, 1, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch,tp,pp,ep", CASES, ids=["tp2-dense", "pp2-dense", "ep2-qwen3-moe"])
def test_hf_engine_logprobs_equal_actor_after_update(tmp_path, arch, tp, pp, ep):
    hf_dir = make_tiny_model(arch, tmp_path / arch)
    results = run_ranks(f"{__name__}:update_then_sync_hf", tp * pp * ep,
                        {"hf_dir": str(hf_dir), "tp": tp, "pp": pp, "ep": ep}, timeout=600)
    diffs = [r["diff"] for r in results if r["diff"] is not None]
    tol = sampled_bound(hf_dir, results[0], ep)
    print(f"[measured] hf engine {arch} tp{tp} pp{pp} ep{ep}: engine vs actor {max(diffs):.2e} (bound {tol:.2e})")
    assert diffs and max(diffs) < tol, (diffs, tol)
    for sync in (results[0]["first"], results[0]["sync"]):
        assert sync["weight_sync/verified_tensors"] > 0 and sync["weight_sync/in_place"] == 1.0, sync
        # every piece written by its host straight into the engine's parameters (megarl.sync.placement)
        assert sync["weight_sync/placed_bytes"] == sync["weight_sync/bytes"] > 0, sync
        for kind in ("sent", "received", "loaded"):  # what moved is what the plan says
            assert sync[f"weight_sync/{kind}_bytes_max"] == sync[f"weight_sync/plan_{kind}_bytes_max"], sync
