"""Image prompts in verl's multimodal row shape: an `images` column (data.image_key) beside chat messages whose text
holds one `<image>` placeholder per image, in order.

    {"prompt": [{"role": "user", "content": "<image>How many circles are there?"}],
     "images": [{"bytes": b"\\x89PNG...", "path": null}],   # or "images": ["figures/q17.png"] (paths beside the file)
     "data_source": "shapes", "reward_model": {"ground_truth": "3"}}

An image is encoded bytes (a {"bytes": ...} struct as HF datasets writes it, or raw bytes) or a path (a {"path": ...}
struct or a string), a relative path taken from the data file's folder. `row_image_problem` names what is wrong with
one row (megarl validate reports each bad row: megarl.data.checks.check_image_rows); the loader keeps the references
(`PromptRecord.images`) and decodes nothing.
"""
from __future__ import annotations

import io
import os
from typing import Any, Optional, Union

PLACEHOLDER = "<image>"
ImageRef = Union[bytes, str]  # encoded image bytes, or a path


def placeholders(prompt: Any) -> int:
    """How many `<image>` placeholders the prompt's text holds (chat messages: all their contents)."""
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDER)
    return sum(str(m.get("content", "")).count(PLACEHOLDER) for m in prompt or () if isinstance(m, dict))


def image_refs(value: Any, base_dir: str) -> list[ImageRef]:
    """The row's images as bytes or absolute paths. Raises ValueError naming the entry that is neither."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"the images column must be a list of images (bytes, a path, or {{'bytes', 'path'}}), got "
                         f"{type(value).__name__}")
    refs: list[ImageRef] = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            refs.append(bytes(item))
        elif isinstance(item, str) and item:
            refs.append(item if os.path.isabs(item) else os.path.join(base_dir, item))
        else:
            raise ValueError(f"image {i} is neither encoded bytes nor a path: {item!r:.80}")
    return refs


def decode_problem(ref: ImageRef) -> Optional[str]:
    """Why the image cannot be read (None: PIL decodes it)."""
    from PIL import Image

    if isinstance(ref, str) and not os.path.isfile(ref):
        return f"image file {ref} does not exist"
    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
            im.load()
    except Exception as e:  # noqa: BLE001 - PIL raises several types for a damaged or unknown image
        what = ref if isinstance(ref, str) else f"{len(ref)} bytes"
        return f"image {what} is not a decodable image ({type(e).__name__}: {str(e)[:120]})"
    return None


def pairing_problem(prompt: Any, refs: list) -> Optional[str]:
    """Why the prompt's placeholders and the row's images do not pair up one to one (None: they do)."""
    wanted = placeholders(prompt)
    if wanted == len(refs):
        return None
    more = "more" if wanted > len(refs) else "fewer"
    return (f"the prompt has {wanted} {PLACEHOLDER} placeholder(s) and the row {len(refs)} image(s) ({more} "
            f"placeholders than images): each image needs one {PLACEHOLDER} where it goes in the text")


def row_image_problem(prompt: Any, images: Any, base_dir: str) -> Optional[str]:
    """What is wrong with one row's images (None: nothing): an unreadable images column, placeholders and images
    that do not pair up one to one, or a missing or undecodable image."""
    try:
        refs = image_refs(images, base_dir)
    except ValueError as e:
        return str(e)
    problem = pairing_problem(prompt, refs)
    for ref in refs if problem is None else ():
        problem = decode_problem(ref)
        if problem is not None:
            break
    return problem
