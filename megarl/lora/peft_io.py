"""PEFT adapter directories (adapter_config.json + adapter_model.safetensors), read and written with PEFT's own API.

    settings = settings_from_peft(adapter_dir)       # rank, alpha, dropout, target_modules of the adapter
    tensors = read_adapter(adapter_dir)              # {PEFT key: tensor}, peft.utils.load_peft_weights
    write_adapter(out_dir, tensors, settings, base_model_path)

Only what megarl trains is accepted: plain LoRA (no DoRA, rsLoRA, per-module rank/alpha patterns, biases or
modules_to_save), on the HF projections megarl.lora.targets knows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from megarl.lora.targets import ALL_LINEAR, LoraError, LoraSettings


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - the test/cpu extras install it
        raise LoraError("reading or writing PEFT adapter directories needs the `peft` package "
                        "(pip install peft)") from exc
    return peft


def settings_from_peft(adapter_dir: Union[str, Path]) -> LoraSettings:
    """LoraSettings of a PEFT LoRA adapter directory; refuses PEFT features megarl does not implement, by name."""
    peft = _peft()
    cfg = peft.PeftConfig.from_pretrained(str(adapter_dir))
    if str(getattr(cfg, "peft_type", "")).split(".")[-1].upper() != "LORA":
        raise LoraError(f"{adapter_dir}: peft_type {cfg.peft_type} is not LORA")
    unsupported = {"use_dora": bool(getattr(cfg, "use_dora", False)),
                   "use_rslora": bool(getattr(cfg, "use_rslora", False)),
                   "rank_pattern": bool(getattr(cfg, "rank_pattern", None)),
                   "alpha_pattern": bool(getattr(cfg, "alpha_pattern", None)),
                   "modules_to_save": bool(getattr(cfg, "modules_to_save", None)),
                   "target_parameters": bool(getattr(cfg, "target_parameters", None)),
                   "bias": getattr(cfg, "bias", "none") != "none", "fan_in_fan_out": bool(cfg.fan_in_fan_out)}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoraError(f"{adapter_dir}: adapter_config.json uses {bad}, which megarl's LoRA does not implement "
                        "(plain LoRA only)")
    targets = cfg.target_modules
    if isinstance(targets, str):
        targets = ALL_LINEAR if targets == ALL_LINEAR else (targets,)
    else:
        targets = tuple(sorted(targets))
    return LoraSettings(rank=int(cfg.r), alpha=float(cfg.lora_alpha), dropout=float(cfg.lora_dropout),
                        target_modules=targets)


def read_adapter(adapter_dir: Union[str, Path]) -> dict:
    """{PEFT key: tensor} of an adapter directory, through peft.utils.load_peft_weights (safetensors or .bin)."""
    peft = _peft()
    return dict(peft.utils.load_peft_weights(str(adapter_dir), device="cpu"))


def write_adapter(out_dir: Union[str, Path], tensors: dict, settings: LoraSettings,
                  base_model_path: Optional[str] = None, target_modules: Optional[list] = None) -> Path:
    """Write a PEFT adapter directory that peft.PeftModel.from_pretrained(base, out_dir) loads.

    tensors: {PEFT key: whole tensor} (megarl.lora.layers.gather_adapters); target_modules: the HF short names
    (default: those of the settings)."""
    peft = _peft()
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = target_modules or (ALL_LINEAR if settings.target_modules == ALL_LINEAR
                                 else sorted(settings.target_modules))
    if modules != ALL_LINEAR:  # PEFT matches module names: name the ones the tensors adapt (Mixtral's w1/w2/w3 too)
        modules = sorted({k.split(".")[-3] for k in tensors})
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=modules, bias="none", task_type="CAUSAL_LM",
                             base_model_name_or_path=base_model_path)
    config.save_pretrained(str(out))
    save_file({k: v.detach().to(torch.float32).contiguous() if v.dtype == torch.float32 else v.contiguous()
               for k, v in tensors.items()}, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
