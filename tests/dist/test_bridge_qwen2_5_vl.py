"""Qwen2.5-VL: HF -> megarl (TP1, TP2, PP2, TP2 x PP2 over gloo) -> logprobs equal HF transformers' Qwen2_5_VLForConditionalGeneration
within the float32 bound derived from the model's widths and depth (the vision tower's included), and HF -> megarl ->
export is bitwise the input checkpoint, vision tower included (TP2, PP2, TP2 x PP2; a tied-embedding variant at TP2
in the slow tier).

Two comparisons per layout on rows of text around one image each (three images of different sizes: merged grids
2 x 4, 3 x 3 and 5 x 2, so windows are cut short at the edges):
- the language model alone: no pixel_values, the placeholders keep their token embeddings (the same inputs_embeds on
  both sides), M-RoPE positions from megarl's own computation against transformers' get_rope_index inside its forward;
- the whole model: the vision tower and merger's image embeddings placed on the placeholders.
And at TP1 the comparison is shown to fail where it must: 1D positions instead of M-RoPE, one image's positions off
by one, the image placeholders shifted by one token.
"""
import pytest

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import read_checkpoint
from tests.helpers.tiny_vlm import hf_vl_logits, logprobs_of, make_tiny_vl_model, synthetic_image, vl_batch

pytestmark = pytest.mark.parity
IMAGES = [(100, 60), (84, 84), (70, 130)]
SEQ = 40


def vl_rank(hf_dir: str, batch: dict, tp: int, negatives: bool, export: bool, pp: int = 1):
    """Load the checkpoint at TP `tp` x PP `pp`; return {name: logprobs [B, S-1]} (TP rank 0 of the last stage only,
    else None) of the variants and the export round trip's problems (or None)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.bridge import export_to_dict
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.vlm import mrope_positions, vl_logits

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=7)
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    model.eval()
    tokens, pixels, grid = batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"]

    def logprobs(ids, with_images=True, positions=None):
        with torch.no_grad():
            local = vl_logits(model, ids, pixels if with_images else None, grid, positions)
            if local is None:  # not the last pipeline stage
                return None
            logits = gather_from_tensor_model_parallel_region(local)[..., : spec.vocab_size]
        return logprobs_of(logits, tokens)  # scored against the true next tokens

    out = {"text": logprobs(tokens, with_images=False), "images": logprobs(tokens)}
    if negatives:
        b, s = tokens.shape
        out["positions_1d"] = logprobs(tokens, positions=torch.arange(s).expand(3, b, s))
        wrong = mrope_positions(tokens, grid, spec.vision)
        row, start = 1, int(batch["image_start"][1])
        n = int(grid[1].prod()) // 4
        wrong[1, row, start:start + n] += 1  # one image's height positions off by one
        out["image_rows_off_by_one"] = logprobs(tokens, positions=wrong)
        shifted = tokens.clone()
        for r in range(b):  # every placeholder run one token later (the token after it moves before it)
            st = int(batch["image_start"][r])
            k = int(grid[r].prod()) // 4
            shifted[r, st:st + k + 1] = torch.cat([tokens[r, st + k + 1:st + k + 2], tokens[r, st:st + k]])
        out["image_tokens_shifted"] = logprobs(shifted)
        if spec.vision.tower == "qwen3_vl":  # what Qwen3-VL adds, each left out in turn
            import contextlib

            from megarl.megatron import vlm

            added, vlm.deepstack_added = vlm.deepstack_added, lambda *a: contextlib.nullcontext()
            out["without_deepstack"] = logprobs(tokens)
            vlm.deepstack_added = added
            interleaved = model.rotary_pos_emb
            model.rotary_pos_emb = interleaved.inner  # megatron's contiguous sections
            out["contiguous_mrope"] = logprobs(tokens)
            model.rotary_pos_emb = interleaved
    problems = None
    if export:
        exported = {k: v.cpu() for k, v in export_to_dict(model, spec, bucket_bytes=64 << 10).items()}
        ref = read_checkpoint(hf_dir)
        problems = [f"missing {k}" for k in ref if k not in exported] + [f"extra {k}" for k in exported if k not in ref]
        problems += [f"differs {k}" for k in ref if k in exported and (exported[k].dtype != ref[k].dtype
                                                                       or not torch.equal(exported[k], ref[k]))]
    keep = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()
    return {"logprobs": out if keep else None, "export": problems}


def vl_case(hf_dir: str, seed: int = 2) -> tuple:
    """(hf_dir, its batch, {"text" | "images": (HF's logprobs, the derived bound)}) of a tiny VL checkpoint."""
    import torch

    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound

    batch = vl_batch(hf_dir, [synthetic_image(w, h, i) for i, (w, h) in enumerate(IMAGES)], seq_len=SEQ, seed=seed)
    spec = load_spec(hf_dir)
    tokens = batch["input_ids"]
    refs = {}
    longest_frame = int(batch["image_grid_thw"][:, 1:].prod(-1).max())
    for name, images in (("text", False), ("images", True)):
        logits = hf_vl_logits(hf_dir, batch, images=images)
        rms = float(logits[:, :-1].pow(2).mean().sqrt())
        bound = fp32_bound(spec, SEQ, tokens.numel() - tokens.shape[0], rms,
                           vision_segment=longest_frame if images else 0)
        refs[name] = (logprobs_of(logits, tokens), bound)
    assert not torch.allclose(refs["text"][0], refs["images"][0], atol=0.1)  # the images matter
    return hf_dir, batch, refs


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The tiny model, its batch, HF's logprobs with and without images and the derived bound of each."""
    return vl_case(str(make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", seed=4)))


def _run(vl, tp: int, negatives: bool, export: bool, pp: int = 1, name: str = "qwen2_5_vl") -> dict:
    hf_dir, batch, refs = vl
    results = run_ranks(f"{__name__}:vl_rank", tp * pp, {"hf_dir": hf_dir, "batch": batch, "tp": tp, "pp": pp,
                                                         "negatives": negatives, "export": export}, timeout=600)
    assert sum(r["logprobs"] is not None for r in results) == 1  # TP rank 0 of the last stage
    for rank, r in enumerate(results):
        assert r["export"] in (None, []), f"rank {rank}: export round trip problems {r['export'][:10]}"
    got = next(r["logprobs"] for r in results if r["logprobs"] is not None)
    for variant in ("text", "images"):
        ref, bound = refs[variant]
        diff = (got[variant] - ref).abs().max().item()
        print(f"[{name} tp{tp} pp{pp}] {variant}: max |logprob diff| = {diff:.2e} (bound {bound:.2e})")
        assert diff < bound, f"{variant} at TP{tp} PP{pp}: max abs logprob diff {diff:.3e} >= bound {bound:.3e}"
    return got


def assert_wrong_inputs_fail(got: dict, refs: dict, name: str, extra: tuple = ()) -> None:
    """1D positions, one image's height positions off by one and shifted placeholders (and the `extra` variants of
    vl_rank) each differ from HF's logprobs with images far beyond the derived bound."""
    ref, bound = refs["images"]
    for variant in ("positions_1d", "image_rows_off_by_one", "image_tokens_shifted") + extra:
        diff = (got[variant] - ref).abs().max().item()
        print(f"[{name} tp1] {variant}: max |logprob diff| = {diff:.2e} (bound {bound:.2e})")
        assert diff > 10 * bound, f"{variant}: the comparison did not catch it ({diff:.3e} vs bound {bound:.3e})"


def test_vl_parity_tp1_and_wrong_inputs_fail(vl):
    assert_wrong_inputs_fail(_run(vl, 1, negatives=True, export=False), vl[2], "qwen2_5_vl")


def test_vl_parity_tp2_and_export_round_trip(vl):
    _run(vl, 2, negatives=False, export=True)


def test_vl_parity_pp2_and_export_round_trip(vl):
    """Pipeline stage 0 holds the vision tower and the first layer; every stage rotates by the same M-RoPE positions."""
    _run(vl, 1, negatives=False, export=True, pp=2)


@pytest.mark.parity_repeat  # the kernels of tp2 and pp2
def test_vl_parity_tp2pp2_and_export_round_trip(vl):
    _run(vl, 2, negatives=False, export=True, pp=2)


def test_megarl_verify_on_a_vl_checkpoint_tp2_pp2(vl, capsys):
    """`megarl verify` draws its own images, places them with the checkpoint's tokenizer and image processor and
    judges against transformers with the derived bound."""
    from megarl.verify import main

    assert main(["--hf", vl[0], "--tp", "2", "--pp", "2", "--batch", "3", "--seq-len", "48"]) == 0
    out = capsys.readouterr().out
    assert "synthetic images (merged grids [[1, 2, 4], [1, 3, 3], [1, 5, 2]])" in out and "): OK" in out, out


@pytest.mark.slow
def test_vl_tied_embeddings_parity_tp2_and_export_round_trip(tmp_path):
    """Qwen2.5-VL-3B's shape: the LM head tied to the embedding (no lm_head.weight in the checkpoint)."""
    import torch

    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound

    hf_dir = str(make_tiny_vl_model(tmp_path / "tied", seed=5, tie_word_embeddings=True))
    assert load_spec(hf_dir).tie_word_embeddings and "lm_head.weight" not in read_checkpoint(hf_dir)
    batch = vl_batch(hf_dir, [synthetic_image(w, h, i + 3) for i, (w, h) in enumerate(IMAGES)], seq_len=SEQ, seed=6)
    refs = {}
    for name, images in (("text", False), ("images", True)):
        logits = hf_vl_logits(hf_dir, batch, images=images)
        bound = fp32_bound(load_spec(hf_dir), SEQ, batch["input_ids"][:, 1:].numel(),
                           float(logits[:, :-1].pow(2).mean().sqrt()),
                           vision_segment=int(batch["image_grid_thw"][:, 1:].prod(-1).max()) if images else 0)
        refs[name] = (logprobs_of(logits, batch["input_ids"]), bound)
    assert not torch.equal(refs["text"][0], refs["images"][0])
    _run((hf_dir, batch, refs), 2, negatives=False, export=True)


def vl_grad_rank(hf_dir: str, batch: dict, tp: int):
    """The vision tower's gradients {name: grad} of the mean next-token loss over the batch at TP `tp` (every rank)."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.megatron.forward import causal_inputs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.vlm import deepstack_added, mrope_positions, vl_embeddings

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=7)
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    tokens, grid = batch["input_ids"], batch["image_grid_thw"]
    decoder_input, deepstack = vl_embeddings(model, tokens, batch["pixel_values"], grid)
    with deepstack_added(model, tokens == spec.vision.image_token_id, deepstack):
        local = model(input_ids=tokens, position_ids=mrope_positions(tokens, grid, spec.vision),
                      attention_mask=causal_inputs(tokens)[1], decoder_input=decoder_input)
    logits = gather_from_tensor_model_parallel_region(local)[..., : spec.vocab_size]
    (-logprobs_of(logits, tokens).mean()).backward()
    return {n: p.grad.clone() for n, p in model.vision_model.named_parameters()}


def assert_tower_gradients_match(vl, name: str) -> None:
    """The replicated tower receives the whole gradient on every TP rank (the same on both, bitwise), equal to
    transformers' on the same loss within the backward's rounding: the forward's relative error (language model and
    vision tower, megarl.numerics) transposed, times each tensor's gradient RMS, twice (two implementations)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import FP32_UNIT, fp32_logit_error_factor, layer_widths, tail_factor, vision_input_error

    hf_dir, batch, _ = vl
    ranks = run_ranks(f"{__name__}:vl_grad_rank", 2, {"hf_dir": hf_dir, "batch": batch, "tp": 2}, timeout=600)
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0])
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    logits = hf(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=batch["mm_token_type_ids"]).logits
    (-logprobs_of(logits, batch["input_ids"]).mean()).backward()
    ref = {n: p.grad for n, p in hf.model.visual.named_parameters()}
    assert set(ref) == set(ranks[0])
    spec = load_spec(hf_dir)
    longest = int(batch["image_grid_thw"][:, 1:].prod(-1).max())
    factor = fp32_logit_error_factor(spec.hidden_size, layer_widths(spec, SEQ), spec.num_layers,
                                     vision_input_error(spec.vision, longest))
    worst = 0.0
    for param, g in ref.items():
        rel = 2 * factor * FP32_UNIT * tail_factor(g.numel())
        scale = float(g.pow(2).mean().sqrt())
        diff = float((ranks[0][param] - g).abs().max())
        assert scale > 0 and diff <= rel * scale, f"{param}: max |grad diff| {diff:.3e} > {rel * scale:.3e}"
        worst = max(worst, diff / (rel * scale))
    print(f"[{name} tp2] vision gradients: worst max |diff| / bound = {worst:.3f}")


@pytest.mark.slow
def test_vision_tower_gradients_at_tp2_equal_transformers(vl):
    assert_tower_gradients_match(vl, "qwen2_5_vl")
