"""Qwen3-VL (dense) in the bridge: its config read into an ArchSpec (Qwen3's q/k norms, interleaved M-RoPE, the
vision tower with learned positions and DeepStack; refusals naming the field), the mapping's names and shapes are the
checkpoint's, megarl's interleaved rotary axes and M-RoPE positions against transformers', and megarl's vision tower
against transformers' model.visual (merged embeddings and DeepStack features) within the derived float32 bound."""
import json

import pytest

from megarl.bridge.hf_config import BridgeError, check_layout, load_spec, spec_from_dict
from tests.helpers.tiny_vlm import make_tiny_vl_model, synthetic_image, vl_batch

# 32-pixel merged cells: merged grids 2 x 3, 3 x 3 and 4 x 2 patches' cells; the 8 x 8 position table is resampled
# to patch grids of 4 x 6, 6 x 6 and 8 x 4
IMAGES = [(100, 60), (84, 84), (70, 130)]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    hf_dir = make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen3_vl", seed=1, architecture="qwen3_vl")
    batch = vl_batch(hf_dir, [synthetic_image(w, h, i) for i, (w, h) in enumerate(IMAGES)], seq_len=40)
    return hf_dir, batch


def _config(hf_dir) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def test_tiny_qwen3_vl_spec_reads_text_and_vision_config(tiny_vl):
    from transformers import AutoConfig

    hf_dir, _ = tiny_vl
    spec = load_spec(hf_dir)
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    text, vision = cfg.text_config, cfg.vision_config
    assert spec.family == "qwen3_vl" and spec.qk_layernorm and not spec.qkv_bias and not spec.tie_word_embeddings
    assert (spec.hidden_size, spec.num_layers, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
            spec.ffn_hidden_size, spec.vocab_size) == (text.hidden_size, text.num_hidden_layers,
                                                       text.num_attention_heads, text.num_key_value_heads,
                                                       text.head_dim, text.intermediate_size, text.vocab_size)
    assert spec.rope.mrope_section == tuple(text.rope_parameters["mrope_section"]) and spec.rope.mrope_interleaved
    v = spec.vision
    assert (v.tower, v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.patch_size, v.hidden_act,
            v.num_position_embeddings, v.deepstack_visual_indexes) == (
        "qwen3_vl", vision.depth, vision.hidden_size, vision.num_heads, vision.intermediate_size, vision.patch_size,
        vision.hidden_act, vision.num_position_embeddings, tuple(vision.deepstack_visual_indexes))
    assert batch_grid(tiny_vl) == [[1, 4, 6], [1, 6, 6], [1, 8, 4]]


def batch_grid(tiny_vl):
    return tiny_vl[1]["image_grid_thw"].tolist()


@pytest.mark.parametrize("change,field", [
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 6, 4]), "mrope_section"),
    (lambda c: c["vision_config"].update(hidden_act="silu"), "hidden_act"),
    (lambda c: c["vision_config"].update(num_position_embeddings=60), "num_position_embeddings"),
    (lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 3]), "deepstack_visual_indexes"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias"),
])
def test_unsupported_qwen3_vl_configs_are_refused_naming_the_field(tiny_vl, change, field):
    cfg = _config(tiny_vl[0])
    change(cfg)
    with pytest.raises(BridgeError, match=field):
        spec_from_dict(cfg)


def test_pipeline_stages_keep_the_deepstack_layers_with_the_vision_tower(tiny_vl):
    spec = load_spec(tiny_vl[0])  # 4 layers, DeepStack into layers 0 and 1
    check_layout(spec, 2, 2)  # [2, 2]
    with pytest.raises(BridgeError, match="DeepStack adds image features after layers 0..1"):
        check_layout(spec, 1, 4)
    with pytest.raises(BridgeError, match="num_layers_in_first_pipeline_stage >= 2"):
        check_layout(spec, 1, 2, first_stage=1)


def test_mapping_names_and_shapes_are_the_checkpoints(tiny_vl):
    from megarl.bridge.mapping import Mapping
    from tests.helpers.tiny_models import read_checkpoint

    hf_dir, _ = tiny_vl
    ckpt = {k: tuple(t.shape) for k, t in read_checkpoint(hf_dir).items()}
    assert Mapping(load_spec(hf_dir)).hf_shapes() == ckpt
    # patch embedding and its bias, the position table, 3 blocks of 12, the merger's 6 and two DeepStack mergers'
    assert sum(k.startswith("model.visual.") for k in ckpt) == 3 + 3 * 12 + 6 + 2 * 6


def test_interleaved_axes_and_positions_equal_transformers(tiny_vl):
    """megarl's per-pair axes against transformers' recomposition (fed the axis number as the frequency), and its
    M-RoPE positions against get_rope_index."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from megarl.megatron.vlm import interleaved_axes, mrope_positions

    hf_dir, batch = tiny_vl
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32)
    rotary = model.model.language_model.rotary_emb
    for section in ((4, 6, 6), (24, 20, 20), (16, 24, 24)):
        rotary.mrope_section = list(section)
        pairs = sum(section)
        tagged = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 1, 1, pairs).clone()
        ref = rotary.recomposition_frequencies(tagged)[0, 0, :pairs].long()
        assert torch.equal(interleaved_axes(section, pairs), ref), section
    ref, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    got = mrope_positions(batch["input_ids"], batch["image_grid_thw"], load_spec(hf_dir).vision)
    assert torch.equal(got, ref)


def test_vision_tower_equals_transformers_visual_within_the_derived_bound(tiny_vl):
    """megarl's Qwen3-VL tower loaded through the mapping's vision entries gives transformers' merged image embeddings
    and DeepStack features within float32 rounding (vision_error_factor * u relative per value, two implementations
    apart, the largest of n values within tail_factor(n) spreads); without the learned positions it does not."""
    import math

    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from megarl.megatron.vlm import Qwen3VisionTower
    from megarl.numerics import FP32_UNIT, tail_factor, vision_error_factor
    from tests.helpers.tiny_vlm import tower_from_checkpoint

    hf_dir, batch = tiny_vl
    spec = load_spec(hf_dir)
    tower = tower_from_checkpoint(Qwen3VisionTower, hf_dir, spec)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    with torch.no_grad():
        out = hf.model.visual(pixels, grid_thw=grid)
        merged, deep = tower(pixels, grid)
    longest = int(grid[:, 1:].prod(-1).max())
    factor = vision_error_factor(spec.vision, longest)
    pairs = [("merged", merged, out.pooler_output)] + [(f"deepstack {i}", g, r) for i, (g, r) in
                                                       enumerate(zip(deep, out.deepstack_features))]
    assert len(deep) == len(out.deepstack_features) == 2
    bounds = {}
    for name, got, ref in pairs:
        rms = float(ref.pow(2).mean().sqrt())
        bounds[name] = tail_factor(ref.numel()) * math.sqrt(2) * factor * FP32_UNIT * rms
        diff = float((got - ref).abs().max())
        print(f"{name}: max |diff| {diff:.2e} (bound {bounds[name]:.2e})")
        assert got.shape == ref.shape and diff < bounds[name], name
    with torch.no_grad():  # the learned positions matter far beyond the bound
        tower.pos_embed.weight.zero_()
        assert float((tower(pixels, grid)[0] - out.pooler_output).abs().max()) > 10 * bounds["merged"]


def test_verify_refuses_a_layout_that_splits_deepstack_from_the_tower_in_one_line(tiny_vl, capsys):
    from megarl.verify import main

    assert main(["--hf", str(tiny_vl[0]), "--pp", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DeepStack" in err and "Traceback" not in err, err


def test_weight_sync_layout_and_plan_hold_the_tower_whole_on_the_first_stage(tiny_vl):
    """The sync's layout puts every vision tensor (DeepStack mergers and position table included) whole on each TP rank
    of stage 0; the planner counts the checkpoint's elements, the tower's among them."""
    import math

    from megarl.bridge.mapping import VISION_PREFIX, Mapping
    from megarl.plan.counts import profile
    from megarl.sync.shards import layout_owners
    from tests.helpers.tiny_models import read_checkpoint

    hf_dir = tiny_vl[0]
    owners = layout_owners(Mapping(load_spec(hf_dir)), tp=2, pp=2, ep=1, world=4)
    vision = [n for n in owners if n.startswith(VISION_PREFIX)]
    assert len(vision) == 3 + 3 * 12 + 6 + 2 * 6
    assert all(sorted(owners[n]) == [(0, 0, 1), (1, 0, 1)] for n in vision)
    ckpt = read_checkpoint(hf_dir)
    p = profile(_config(hf_dir))
    assert p.total == sum(t.numel() for t in ckpt.values())
    assert p.vision == sum(math.prod(t.shape) for k, t in ckpt.items() if k.startswith("model.visual."))


def test_transformers_4_config_with_rope_scaling_reads_the_same(tiny_vl):
    """Qwen3-VL's released config.json files (transformers 4.57) keep rope_theta in text_config and the M-RoPE fields
    in rope_scaling {rope_type: default, mrope_section, mrope_interleaved: true}."""
    cfg = _config(tiny_vl[0])
    rope = cfg["text_config"].pop("rope_parameters")
    cfg["text_config"].update(rope_theta=rope["rope_theta"], rope_scaling={
        "rope_type": "default", "mrope_section": rope["mrope_section"], "mrope_interleaved": True})
    assert spec_from_dict(cfg) == load_spec(tiny_vl[0])
