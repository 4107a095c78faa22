"""Image prompts through the RL data path: the hf engine samples from a tiny random Qwen2.5-VL (and Qwen3-VL) with
each prompt's images, the trainer builds the step's batch (prompt tokens with their placeholder runs, each sample's
images beside them) and the actor recomputes the sampled tokens' logprobs in packed micro-batches (several rows and
images per pack, fixed and token-budget micro-batches, TP1, TP2 and PP2: the tower on the first stage, positions on
every stage), and its on-policy update's own forward computes them again. Both must equal the engine's within the
float32 bound derived from the model's widths, depth, vision tower and logits (megarl.numerics.fp32_bound): the engine
is transformers' model with its own KV cache, the trainer megatron's, the same function. Another row's image, or
M-RoPE positions with an image's rows off by one, must fail that bound by far.
"""
import io
import json
from pathlib import Path

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.tiny_vlm import hf_row_logits, make_tiny_vl_model, synthetic_image

pytestmark = pytest.mark.parity

# four prompts, two samples each: the first two images of one size (one grid) and different content, the third of
# another size (another grid and token count), the fourth text only (packed beside image rows)
SIZES = [(100, 60), (100, 60), (70, 90), None]
N_SAMPLES, RESPONSE = 2, 10


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_records(hf_dir):
    from transformers import AutoTokenizer

    from megarl.data.dataset import PromptRecord
    from megarl.data.encode import encode_prompts
    from megarl.data.vision import ImagePrompts

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    records = [PromptRecord(index=i, uid=f"p{i}", prompt=({"role": "user", "content": f"<image>shape {i} ?"
                                                           if size else f"text {i} only ?"},),
                            data_source="shapes", ground_truth="1",
                            images=(png(synthetic_image(*size, i)),) if size else ())
               for i, size in enumerate(SIZES)]
    images = ImagePrompts(str(hf_dir), tok)
    records, _, _ = encode_prompts(records, tok, 128, images=images)
    return records, images, tok


def rollout_batch(hf_dir):
    """(the step's training batch with its images, the engine's rollout, the derived bound)."""
    from megarl.batching import build_train_batch
    from megarl.bridge.hf_config import load_spec
    from megarl.config.schema import RolloutConfig
    from megarl.numerics import fp32_bound
    from megarl.rollout.hf.engine import HFEngine

    records, images, tok = make_records(hf_dir)
    engine = HFEngine(RolloutConfig(name="hf", n=N_SAMPLES, prompt_length=128, response_length=RESPONSE,
                                    ignore_eos=True, max_num_seqs=16), str(hf_dir), seed=0, device="cpu")
    rollout = engine.generate([r.prompt_ids for r in records], seed=3, images=[r.images for r in records])
    batch = build_train_batch(rollout, torch.zeros(len(rollout)), tok.pad_token_id)
    batch.update(images.batch_images(records, rollout.prompt_index))
    # the bound: the engine model's logits at the response positions (their RMS), the longest row, the largest frame
    rows, longest = [], 0
    for i in range(len(rollout)):
        refs = records[int(rollout.prompt_index[i])].images
        pixels, grid = images.pixels(refs) if refs else (None, None)
        ids = torch.tensor([list(rollout.prompt_ids[i]) + list(rollout.response(i))])
        p = len(rollout.prompt_ids[i])
        logits = hf_row_logits(engine.model, ids, p, pixels, grid)
        rows.append(logits[p - 1:p + int(rollout.response_lengths[i]) - 1].float())
        longest = max(longest, ids.shape[1])
    logits = torch.cat(rows)
    frame = int(batch["image_grid_thw"][..., 1:].prod(-1).max())
    bound = fp32_bound(load_spec(str(hf_dir)), longest, logits.shape[0], float(logits.pow(2).mean().sqrt()),
                       vision_segment=frame)
    engine.shutdown()
    return batch, rollout, bound


def _config(tp: int, pp: int, dynamic_bsz: bool, micro: int):
    from megarl.config import MegarlConfig

    n = len(SIZES) * N_SAMPLES
    return MegarlConfig.model_validate({
        "trainer": {"n_gpus_per_node": tp * pp, "total_steps": 2, "seed": 4},
        "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        "data": {"train_batch_size": len(SIZES)},
        "rollout": {"name": "hf", "n": N_SAMPLES, "log_prob_micro_batch_size_per_gpu": micro,
                    "log_prob_use_dynamic_bsz": dynamic_bsz, "log_prob_max_token_len_per_gpu": 120},
        "actor": {"ppo_mini_batch_size": n // N_SAMPLES, "ppo_micro_batch_size_per_gpu": micro,
                  "use_dynamic_bsz": dynamic_bsz, "ppo_max_token_len_per_gpu": 120,
                  "optim": {"lr": 1e-3, "weight_decay": 0.0, "clip_grad": 0.0}}})


def gap_rank(hf_dir, batch, tp, pp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.megatron import vlm
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.workers import PolicyWorker
    from megarl.runtime import Runtime

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    rt = Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=ps.get_data_parallel_rank(),
                 dp_size=ps.get_data_parallel_world_size(), run_dir=None)
    out = {}
    for name, dynamic, micro in (("fixed", False, 3), ("budget", True, 3)):
        actor = PolicyWorker(hf_dir, _config(tp, pp, dynamic, micro), trainable=True)
        out[name] = actor.log_probs(batch, rt)
    # another row's images: the samples of prompts 0 and 1 (one grid, other pixels) swap theirs
    wrong = dict(batch)
    swap = torch.tensor([2, 3, 0, 1] + list(range(4, len(batch["input_ids"]))))
    wrong["pixel_values"] = batch["pixel_values"][swap]
    out["wrong_image"] = actor.log_probs(wrong, rt)
    original = vlm.packed_mrope_positions

    def shifted(pack, grids, vision):  # an image's rows off by one
        pos = original(pack, grids, vision)
        pos[1] += (pack.ids == vision.image_token_id).long()
        return pos

    vlm.packed_mrope_positions = shifted
    try:
        out["shifted"] = actor.log_probs(batch, rt)
    finally:
        vlm.packed_mrope_positions = original
    # the on-policy update's own forward: the logprobs it trains on, before its step
    b = dict(batch, advantages=torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0)))
    PolicyWorker(hf_dir, _config(tp, pp, True, 3), trainable=True).update(b, rt, step=1, on_policy=True)
    out["update"] = b["old_log_probs"]
    return out


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def case(request, tmp_path_factory):
    hf_dir = make_tiny_vl_model(tmp_path_factory.mktemp("vl_gap") / request.param, architecture=request.param)
    return (str(hf_dir), *rollout_batch(hf_dir))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_trainer_logprobs_equal_the_hf_engines_with_images(case, tp, pp):
    hf_dir, batch, rollout, bound = case
    mask = batch["response_mask"]
    results = run_ranks(f"{__name__}:gap_rank", tp * pp, {"hf_dir": hf_dir, "batch": batch, "tp": tp, "pp": pp},
                        timeout=600)
    got = results[0]
    engine = batch["rollout_log_probs"]
    for name in ("fixed", "budget", "update"):
        diff = ((got[name] - engine).abs() * mask).max().item()
        print(f"[measured] tp{tp} pp{pp} {name}: trainer vs hf engine {diff:.2e} (bound {bound:.2e})")
        assert diff < bound, (name, diff, bound)
    for name in ("wrong_image", "shifted"):
        diff = ((got[name] - engine).abs() * mask).max().item()
        print(f"[measured] tp{tp} pp{pp} {name}: trainer vs hf engine {diff:.2e} (bound {bound:.2e})")
        assert diff > 10 * bound, (name, diff, bound)
    # image tokens are prompt tokens: never in the response mask
    image_id = json.loads((Path(hf_dir) / "config.json").read_text())["image_token_id"]
    assert int((batch["input_ids"] == image_id).sum()) > 0
    assert not (mask & (batch["input_ids"][:, 1:] == image_id)).any()
