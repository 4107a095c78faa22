"""Image prompts in the RL batch (megarl.data.vision, megarl.batching, megarl.megatron.vlm's packed helpers):

* a prompt's ids hold each image's placeholder run where its `<image>` was: the same ids the tokenizer gives the chat
  text with the run spelled out as Qwen's processor writes it (<|vision_start|> <|image_pad|> x t*h*w/4
  <|vision_end|>, t, h, w from the image processor's grid);
* each sample's images ride beside its tokens (pixel_values / image_grid_thw padded per row) and stay whole and
  row-aligned through select_rows, split_micro and split_by_token_budget; row_images undoes the padding;
* a pack's M-RoPE positions equal transformers' get_rope_index row by row, also where a response sampled an image
  or video token (text: the engine fed it as text), and only the prompt's image tokens are placeholders;
* an image prompt over prompt_length is refused rather than cut (data.truncation=left/right would cut its run).
"""
import io

import pytest
import torch

from tests.helpers.tiny_vlm import make_tiny_vl_model, synthetic_image


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import AutoTokenizer

    from megarl.data.vision import ImagePrompts

    hf_dir = make_tiny_vl_model(tmp_path_factory.mktemp("vl_batch") / "qwen2_5_vl")
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    return hf_dir, tok, ImagePrompts(str(hf_dir), tok)


def record(i: int, images: tuple, text: str = "<image>what colour ?"):
    from megarl.data.dataset import PromptRecord

    return PromptRecord(index=i, uid=f"p{i}", prompt=({"role": "user", "content": text},), data_source="shapes",
                        ground_truth="red", images=images)


def test_prompt_ids_spell_each_images_run_where_its_placeholder_was(vl):
    _, tok, images = vl
    a, b = png(synthetic_image(100, 60, 0)), png(synthetic_image(70, 90, 1))
    rec = record(0, (a, b), "first <image> then <image> and ?")
    _, grid = images.pixels([a, b])
    runs = ["<|vision_start|>" + "<|image_pad|>" * (t * h * w // 4) + "<|vision_end|>" for t, h, w in grid.tolist()]
    chat = tok.apply_chat_template([{"role": "user", "content": f"first {runs[0]} then {runs[1]} and ?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert images.prompt_ids(rec) == tok(chat, add_special_tokens=False)["input_ids"]
    assert images.prompt_ids(rec).count(images.image_token_id) == sum(t * h * w // 4 for t, h, w in grid.tolist())


def test_images_ride_with_their_rows_through_every_cut(vl):
    from megarl.batching import select_rows, split_by_token_budget, split_micro
    from megarl.megatron.vlm import row_images

    _, _, images = vl
    recs = [record(0, (png(synthetic_image(100, 60, 0)),)), record(1, ()),
            record(2, (png(synthetic_image(56, 56, 2)), png(synthetic_image(70, 90, 3))), "<image><image>?")]
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    out = images.batch_images(recs, index)
    px, grid = out["pixel_values"], out["image_grid_thw"]
    assert grid.shape[:2] == (6, 2) and px.shape[0] == 6
    for i, p in enumerate(index.tolist()):  # each sample's own images first, zeros after
        want_px, want_grid = images.pixels(recs[p].images) if recs[p].images else (torch.zeros(0, px.shape[2]),
                                                                                    torch.zeros(0, 3, dtype=torch.long))
        assert torch.equal(grid[i, :len(want_grid)], want_grid) and not grid[i, len(want_grid):].any()
        assert torch.equal(px[i, :len(want_px)], want_px) and not px[i, len(want_px):].any()
    lengths = torch.tensor([9, 7, 5, 4, 12, 3])
    s = 12
    batch = {"input_ids": torch.arange(6 * s).view(6, s), **out,
             "response_mask": torch.arange(s - 1)[None, :] < (lengths[:, None] - 1)}
    for part in [select_rows(batch, torch.tensor([4, 1])), *split_micro(batch, 3),
                 *split_by_token_budget(batch, 16)]:
        rows = part["input_ids"][:, 0] // s
        assert torch.equal(part["pixel_values"], px[rows]) and torch.equal(part["image_grid_thw"], grid[rows])
    pixels, grids, per_row = row_images(px, grid)
    assert [len(g) for g in per_row] == [1, 1, 0, 0, 2, 2]
    assert torch.equal(grids, torch.cat([images.pixels(recs[p].images)[1] for p in index.tolist() if recs[p].images]))
    assert torch.equal(pixels, torch.cat([images.pixels(recs[p].images)[0] for p in index.tolist()
                                          if recs[p].images]))


def test_pack_positions_equal_transformers_rope_index(vl):
    from transformers import AutoModelForImageTextToText

    from megarl.bridge.hf_config import load_spec
    from megarl.megatron.packing import pack_rows
    from megarl.megatron.vlm import packed_mrope_positions, packed_placeholders

    hf_dir, tok, images = vl
    vision = load_spec(str(hf_dir)).vision
    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir))
    recs = [record(0, (png(synthetic_image(100, 60, 0)),)), record(1, ()),
            record(2, (png(synthetic_image(70, 90, 3)),), "<image> and more text ?")]
    rows, grids, prompts = [], [], []
    for j, r in enumerate(recs):
        ids = images.prompt_ids(r) if r.images else tok.apply_chat_template(
            [{"role": "user", "content": "plain ?"}], add_generation_prompt=True, tokenize=True)["input_ids"]
        # responses: text, with an image token and a video token the policy sampled in rows 0 and 1
        resp = [5, 6, vision.image_token_id, 7, vision.video_token_id, 8][:3 + 3 * (j < 2)]
        rows.append(ids + resp)
        prompts.append(len(ids))
        grids.append(images.pixels(r.images)[1] if r.images else torch.zeros(0, 3, dtype=torch.long))
    s = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (s - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    pack = pack_rows(tokens, lengths, multiple=8)
    assert pack.pad > 0  # the end padding counts too
    got = packed_mrope_positions(pack, grids, vision)[:, 0]
    marks = packed_placeholders(pack, grids, vision)[0]
    for r, row in enumerate(rows):
        ids = torch.tensor([row])
        types = torch.zeros_like(ids, dtype=torch.int)
        types[0, :prompts[r]] = (ids[0, :prompts[r]] == vision.image_token_id).int()
        want, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=types,
                                             image_grid_thw=grids[r] if len(grids[r]) else None)
        at = int(pack.cu_seqlens[r])
        assert torch.equal(got[:, at:at + len(row)], want[:, 0]), r
        assert torch.equal(marks[at:at + len(row)], types[0].bool()), r
    assert torch.equal(got[:, -pack.pad:], torch.arange(pack.pad).expand(3, -1))


def test_an_image_prompt_over_prompt_length_is_refused_not_cut(vl):
    from megarl.data.dataset import DataError
    from megarl.data.encode import encode_prompts

    _, tok, images = vl
    rec = record(0, (png(synthetic_image(100, 60, 0)),))
    n = len(images.prompt_ids(rec))
    for truncation in ("left", "right", "error"):
        with pytest.raises(DataError, match="rollout.prompt_length"):
            encode_prompts([rec], tok, n - 1, truncation, images=images)
    with pytest.raises(DataError, match="has images but no image processor"):
        encode_prompts([rec], tok, n, "error")
    kept, ids, _ = encode_prompts([rec, record(1, ())], tok, n, "filter", images=images)
    assert ids[0] == images.prompt_ids(rec) and kept[0].prompt_ids == tuple(ids[0])


def test_a_vllm_image_request_holds_one_placeholder_per_image_and_the_images(vl):
    """vLLM's processor expands each <|image_pad|> of a token prompt itself: the request carries the chat text's ids
    with one placeholder per image (what Qwen's processor starts from) and the images as multi_modal_data."""
    from megarl.rollout.requests import RequestDriver
    from megarl.rollout.vllm.engine import image_request

    _, tok, images = vl
    a, b = png(synthetic_image(100, 60, 0)), png(synthetic_image(70, 90, 1))
    rec = record(0, (a, b), "first <image> then <image> and ?")
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": f"first {one} then {one} and ?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids, mm = image_request(images.prompt_ids(rec), rec.images, images.image_token_id)
    assert ids == tok(chat, add_special_tokens=False)["input_ids"]
    assert [im.size for im in mm["image"]] == [(100, 60), (70, 90)] and mm["image"][0].mode == "RGB"

    class Engine:  # records what the driver hands vLLM's add_request
        def add_request(self, rid, prompt, params, lora_request=None):
            self.prompt = prompt
            return rid

    class Params:
        n, logprobs = 1, None

    engine = Engine()
    RequestDriver(engine, lambda: 0).add(ids, Params(), mm)
    assert engine.prompt == {"prompt_token_ids": ids, "multi_modal_data": mm}
    RequestDriver(engine, lambda: 0).add(ids, Params())
    assert engine.prompt == {"prompt_token_ids": ids}
