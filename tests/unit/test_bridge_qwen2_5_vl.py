"""Qwen2.5-VL's config in the bridge (ArchSpec with M-RoPE sections and the vision tower; refusals naming the field),
the tiny model and processor inputs the parity tests use, and megarl's own M-RoPE positions against transformers'
get_rope_index."""
import json

import pytest

from megarl.bridge.hf_config import BridgeError, load_spec, spec_from_dict
from tests.helpers.tiny_vlm import make_tiny_vl_model, synthetic_image, vl_batch

IMAGES = [(100, 60), (84, 84), (70, 130)]  # merged grids 2 x 4, 3 x 3 and 5 x 2: windows of 2 x 2, some cut short


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    hf_dir = make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", seed=1)
    batch = vl_batch(hf_dir, [synthetic_image(w, h, i) for i, (w, h) in enumerate(IMAGES)], seq_len=40)
    return hf_dir, batch


def test_tiny_vl_spec_reads_text_and_vision_config(tiny_vl):
    from transformers import AutoConfig

    hf_dir, _ = tiny_vl
    spec = load_spec(hf_dir)
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    text, vision = cfg.text_config, cfg.vision_config
    assert spec.family == "qwen2_5_vl" and spec.qkv_bias and not spec.tie_word_embeddings
    assert (spec.hidden_size, spec.num_layers, spec.num_attention_heads, spec.num_key_value_heads,
            spec.ffn_hidden_size, spec.vocab_size) == (text.hidden_size, text.num_hidden_layers,
                                                       text.num_attention_heads, text.num_key_value_heads,
                                                       text.intermediate_size, text.vocab_size)
    assert spec.rope.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert spec.rope.theta == text.rope_parameters["rope_theta"]
    v = spec.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size, v.window_size,
            v.fullatt_block_indexes) == (vision.depth, vision.hidden_size, vision.num_heads,
                                         vision.intermediate_size, vision.out_hidden_size, vision.window_size,
                                         tuple(vision.fullatt_block_indexes))
    assert (v.image_token_id, v.vision_start_token_id) == (cfg.image_token_id, cfg.vision_start_token_id)


def test_processor_inputs_hold_one_placeholder_per_merged_token(tiny_vl):
    _, batch = tiny_vl
    grid = batch["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 8], [1, 6, 6], [1, 10, 4]]
    assert batch["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert batch["mm_token_type_ids"].sum(-1).tolist() == (grid.prod(-1) // 4).tolist()


def test_megarl_mrope_positions_equal_transformers_get_rope_index(tiny_vl):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megarl.megatron.vlm import mrope_positions

    hf_dir, batch = tiny_vl
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32)
    ref, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    got = mrope_positions(batch["input_ids"], batch["image_grid_thw"], load_spec(hf_dir).vision)
    assert got.shape == ref.shape and torch.equal(got, ref)
    # text after an image resumes at the image's start + its larger merged side, not at its token count
    row = 2
    end = int(batch["image_start"][row]) + 10
    assert int(got[0, row, end]) == int(batch["image_start"][row]) + 5


def _vl_config(hf_dir) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


@pytest.mark.parametrize("change,field", [
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 6, 4]), "mrope_section"),
    (lambda c: c["vision_config"].update(out_hidden_size=64), "out_hidden_size"),
    (lambda c: c["vision_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c["text_config"].update(use_sliding_window=True), "use_sliding_window"),
])
def test_unsupported_vl_configs_are_refused_naming_the_field(tiny_vl, change, field):
    cfg = _vl_config(tiny_vl[0])
    change(cfg)
    with pytest.raises(BridgeError, match=field):
        spec_from_dict(cfg)


def test_older_config_with_text_fields_at_top_level_reads_the_same(tiny_vl):
    """transformers < 5 wrote Qwen2.5-VL's text fields at the top level and rope_scaling {type: mrope}."""
    cfg = _vl_config(tiny_vl[0])
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    cfg.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope",
                                                                  "mrope_section": rope["mrope_section"]})
    assert spec_from_dict(cfg) == load_spec(tiny_vl[0])


def test_vision_patch_positions_and_windows_equal_transformers(tiny_vl):
    """megarl's own window reordering and 2D patch positions against transformers' helpers, on grids whose windows
    are cut short at the edges, and a video-like grid of two frames."""
    import torch
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    from megarl.megatron.vlm import patch_positions, window_order

    v = load_spec(tiny_vl[0]).vision
    for grid in (tiny_vl[1]["image_grid_thw"], torch.tensor([[2, 6, 10], [1, 2, 2]])):
        order, lengths = window_order(grid, v)
        ref_order, ref_cu = get_vision_window_index(grid, v.spatial_merge_size, v.window_size, v.patch_size)
        assert torch.equal(order, ref_order)
        assert torch.cumsum(torch.tensor([0] + lengths), 0).tolist() == ref_cu.tolist()
        assert torch.equal(patch_positions(grid, v.spatial_merge_size), get_vision_position_ids(grid, 2))


def test_mapping_names_and_shapes_are_the_checkpoints(tiny_vl):
    from megarl.bridge.mapping import Mapping
    from tests.helpers.tiny_models import read_checkpoint

    hf_dir, _ = tiny_vl
    ckpt = {k: tuple(t.shape) for k, t in read_checkpoint(hf_dir).items()}
    assert Mapping(load_spec(hf_dir)).hf_shapes() == ckpt
    assert sum(k.startswith("visual.") for k in ckpt) == 1 + 2 * 12 + 5


def test_validate_asks_a_vl_model_for_the_hf_engine_and_verify_refuses_its_unsupported_options_in_one_line(
        tiny_vl, capsys):
    from megarl.bridge.checks import check_architecture
    from megarl.config import load_unchecked
    from megarl.verify import main

    hf_dir, _ = tiny_vl
    issues = check_architecture(load_unchecked(data={"model": {"path": str(hf_dir)}}))  # the default vLLM engine
    assert [i.key for i in issues] == ["rollout.name"] and "vision-language" in issues[0].rule
    assert check_architecture(load_unchecked(data={"model": {"path": str(hf_dir)}, "rollout": {"name": "hf"}})) == []
    for flags, said in ((["--engine", "vllm"], "not yet with --engine vllm"),
                        (["--dtype", "bfloat16"], "not yet with --dtype bfloat16"),
                        (["--tp", "3"], "tensor_model_parallel_size=3 does not divide"),
                        (["--seq-len", "12"], "(the largest gives 10 merged tokens); use --seq-len 14")):
        capsys.readouterr()
        assert main(["--hf", str(hf_dir), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err, err


def test_vision_tower_equals_transformers_visual_within_the_derived_bound(tiny_vl):
    """megarl's tower loaded through the mapping's vision entries gives transformers' merged image embeddings (the
    pooler output of model.visual) to within float32 rounding: relative error vision_error_factor * u per value, two
    implementations apart (sqrt 2), the largest of n values within sqrt(2 ln n) spreads."""
    import dataclasses
    import math

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megarl.megatron.vlm import Qwen25VisionTower
    from megarl.numerics import FP32_UNIT, tail_factor, vision_error_factor
    from tests.helpers.tiny_vlm import tower_from_checkpoint

    hf_dir, batch = tiny_vl
    spec = load_spec(hf_dir)
    tower = tower_from_checkpoint(Qwen25VisionTower, hf_dir, spec)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid).pooler_output
        got = tower(pixels, grid)
    longest = int(grid[:, 1:].prod(-1).max())
    rms = float(ref.pow(2).mean().sqrt())
    bound = tail_factor(ref.numel()) * math.sqrt(2) * vision_error_factor(spec.vision, longest) * FP32_UNIT * rms
    diff = float((got - ref).abs().max())
    print(f"vision tower: max |diff| {diff:.2e} (bound {bound:.2e})")
    assert got.shape == ref.shape and diff < bound
    # the window order matters: the same blocks over frames only (no windows) differ far beyond the bound
    with torch.no_grad():
        tower.spec = dataclasses.replace(spec.vision, fullatt_block_indexes=(0, 1))
        assert float((tower(pixels, grid) - ref).abs().max()) > 10 * bound


def test_weight_sync_layout_puts_the_vision_tower_on_the_first_stage(tiny_vl):
    from megarl.bridge.mapping import VISION_PREFIX, Mapping
    from megarl.sync.shards import layout_owners

    mapping = Mapping(load_spec(tiny_vl[0]))
    owners = layout_owners(mapping, tp=2, pp=2, ep=1, world=4)
    vision = [n for n in owners if n.startswith(VISION_PREFIX)]
    assert len(vision) == 1 + 2 * 12 + 5
    # every TP rank of stage 0 (global ranks 0 and 1) holds the whole tensor (TP size 1: replicated)
    assert all(sorted(owners[n]) == [(0, 0, 1), (1, 0, 1)] for n in vision)


def test_plan_counts_hold_the_vision_tower_whole_on_the_first_stage(tiny_vl):
    import dataclasses
    import math

    from megarl.plan.counts import profile, stage_elements
    from tests.helpers.tiny_models import read_checkpoint

    ckpt = read_checkpoint(tiny_vl[0])
    p = profile(_vl_config(tiny_vl[0]))
    assert p.total == sum(t.numel() for t in ckpt.values())
    assert p.vision == sum(math.prod(t.shape) for k, t in ckpt.items() if k.startswith("visual."))
    without = dataclasses.replace(p, vision=0)
    for first in (True, False):  # TP2: replicated, so whole on each rank of the first stage only
        got = stage_elements(p, [0], 2, 1, 2, first, False)[0] - stage_elements(without, [0], 2, 1, 2, first, False)[0]
        assert got == (p.vision if first else 0)
