"""`megarl import`: a Hugging Face model -> a megarl distributed checkpoint at a TP/PP/EP layout (the reverse of merge).

    megarl import --hf DIR --out CKPT [--tp 2 --pp 2 --ep 1 --etp N] [--model actor|critic] [--dtype float32]

Starts lcm(TP, EP*ETP) * PP ranks on this machine (megarl.launch_local), each loading only its slices of
the safetensors files through the bridge (megarl.bridge.importer), and saves the model with megatron
dist_checkpointing into `CKPT/checkpoints/step_0/<model>/` (model weights, a fresh LR scheduler state, no optimizer
state) with meta.json (complete, "optimizer": false), trainer_state.json (step 0) and a config.resolved.yaml naming
the HF directory. A dist checkpoint loads at any layout, so a large run can start from it without every rank reading
HF safetensors:

    megarl train recipe.yaml checkpoint.resume=CKPT checkpoint.load_optimizer=false

and `megarl merge --ckpt CKPT --out DIR` turns it back into the same HF tensors.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

DESCRIPTION = ("Convert a Hugging Face model into a megarl distributed checkpoint (<out>/checkpoints/step_0) saved at "
               "the given TP/PP/EP layout; it loads at any layout (checkpoint.resume=<out> "
               "checkpoint.load_optimizer=false).")


def import_rank(hf_dir: str, step_tmp: str, model: str, tp: int, pp: int, ep: int, etp: Optional[int],
                dtype: Optional[str], first_stage: Optional[int] = None, last_stage: Optional[int] = None) -> dict:
    """On every rank: load this rank's slices of the HF model at the layout and save them (collective)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.state import _writer_queue_dies_with_rank, sharded_state_dict
    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                               num_layers_in_first_pipeline_stage=first_stage,
                               num_layers_in_last_pipeline_stage=last_stage), seed=0)
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
    net, spec = build_and_load(hf_dir, value_head=model == "critic", **kwargs)
    trainable = make_trainable(net, OptimConfig(), total_steps=1)
    _writer_queue_dies_with_rank()
    dist_checkpointing.save(sharded_state_dict(trainable, with_optimizer=False, is_loading=False),
                            str(Path(step_tmp) / model))
    dist.barrier()
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "dtype": str(next(iter(trainable.chunks[0].parameters())).dtype).replace("torch.", "")}


def import_hf(hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
              etp: Optional[int] = None, model: str = "actor", dtype: Optional[str] = None,
              force: bool = False, first_stage: Optional[int] = None, last_stage: Optional[int] = None) -> Path:
    """Write `out/checkpoints/step_0` from `hf_dir` at the layout; returns the step directory."""
    from megarl.bridge.hf_config import check_layout, load_spec
    from megarl.checkpoint.merge import MergeError
    from megarl.checkpoint.locate import checkpoints_dir, step_dir
    from megarl.launch_local import run_ranks

    hf_dir, out = Path(hf_dir).resolve(), Path(out)
    spec = load_spec(hf_dir)
    check_layout(spec, tp, pp, ep, etp, first_stage, last_stage)
    final = step_dir(checkpoints_dir(out), 0)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise MergeError(f"--out {out}: exists and is not empty; pass --force to replace it")
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(str(final) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / model).mkdir(parents=True)
    # ranks: TP x PP model-parallel groups; experts fold into them (megatron needs EP*ETP*PP to divide the world too),
    # so the world is the smallest multiple of TP*PP that also holds EP*ETP per stage
    per_stage = math.lcm(tp, ep * (etp or tp))
    world = per_stage * pp
    kwargs = {"hf_dir": str(hf_dir), "step_tmp": str(tmp), "model": model, "tp": tp, "pp": pp, "ep": ep, "etp": etp,
              "dtype": dtype, "first_stage": first_stage, "last_stage": last_stage}
    results = run_ranks("megarl.checkpoint.hf_import:import_rank", world, kwargs, timeout=None)
    parallelism = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                   "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
                   "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
                   "num_layers_in_first_pipeline_stage": first_stage, "num_layers_in_last_pipeline_stage": last_stage}
    finish_step_dir(tmp, model, hf_dir, parallelism, world, results[0]["dtype"])
    tmp.rename(final)
    return final


def finish_step_dir(tmp: Path, model: str, hf_dir: Path, parallelism: dict, world: int, dtype: str) -> None:
    """The non-model files of a weights-only step_0 checkpoint (meta.json last, complete)."""
    import yaml

    from megarl import __version__
    from megarl.checkpoint.locate import LAYOUT_VERSION, META_FILE, TRAINER_STATE_FILE

    (tmp / "config.resolved.yaml").write_text(yaml.safe_dump(
        {"model": {"path": str(hf_dir)}, **({"critic": {"model_path": str(hf_dir)}} if model == "critic" else {}),
         "parallelism": parallelism}))
    (tmp / TRAINER_STATE_FILE).write_text(json.dumps({"step": 0}))
    (tmp / META_FILE).write_text(json.dumps({
        "step": 0, "megarl_version": __version__, "layout": LAYOUT_VERSION, "world_size": world,
        "parallelism": parallelism, "models": [model], "optimizer": False, "states": [], "saved_at": time.time(),
        "imported_from": str(hf_dir), "dtype": dtype, "complete": True}, indent=2, sort_keys=True))


def add_arguments(p) -> None:
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json, safetensors)")
    p.add_argument("--out", required=True, help="directory to write (<out>/checkpoints/step_0)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="uneven pipeline stages: parallelism.num_layers_in_first_pipeline_stage")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="uneven pipeline stages: parallelism.num_layers_in_last_pipeline_stage")
    p.add_argument("--model", default="actor", choices=["actor", "critic"], help="save as the actor or the critic")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="parameter dtype (default: megarl's, bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out (replaces its step_0)")


def run(args) -> int:
    from megarl.bridge.hf_config import BridgeError
    from megarl.checkpoint.merge import MergeError
    from megarl.launch_local import RankFailure

    try:
        path = import_hf(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, model=args.model,
                         dtype=args.dtype, force=args.force, first_stage=args.first_stage_layers,
                         last_stage=args.last_stage_layers)
    except (MergeError, BridgeError, RankFailure) as exc:
        print(f"megarl import: {exc}", file=sys.stderr)
        return 1
    print(f"imported {args.hf} -> {path} (TP{args.tp} PP{args.pp} EP{args.ep})", file=sys.stderr)
    return 0
