"""Merge throughput and memory: a >=200M-parameter Llama-like megarl checkpoint saved at TP=2 -> an HF directory.

    .venv/bin/python bench/bench_merge.py [--hidden 1024 --layers 14 --vocab 32000 --tp 2 --dtype bfloat16]
                                          [--workdir DIR] [--max-shard-size 2GB] [--json OUT.json]

1. Two local ranks build a randomly initialised model from an ArchSpec and save it with megatron dist_checkpointing
   (weights only) as a megarl `step_0` checkpoint; config.json is written next to it (no HF weights needed).
2. `megarl merge` runs in a fresh process (python -m megarl.checkpoint.merge_cli); its wall time and peak RSS
   (getrusage of the child) are measured, and merge() alone in a fresh process that imported its modules first;
   --repeats times, alternating with the copy. A second fresh process that only imports the same modules gives the RSS
   baseline (python + torch + megatron), so `peak RSS - baseline` is what the merge itself held.
3. A plain file copy (shutil.copyfile) of the checkpoint's model files, the same bytes read and written, is timed in
   a fresh process too (right after each merge, so both read from the same page-cache state).

Reports GB/s of the merge (HF bytes written / wall time, process start included) and of the copy, and the merge's
memory against the largest single tensor. merge_vs_copy_excl_startup compares the two without their interpreter and
import start-up (merge(): everything from finding the checkpoint to the renamed output directory; the copy: the
copyfile calls), i.e. the part that grows with the model; merge_vs_copy includes it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a merge imports: the RSS baseline, and imported ahead of the timed merge() call
IMPORTS = ("import torch, megarl.checkpoint.merge, megarl.checkpoint.hf_writer, torch.distributed.checkpoint, tqdm, "
           "yaml, safetensors")
sys.path.insert(0, str(ROOT))


def spec_dict(hidden: int, layers: int, vocab: int, dtype: str) -> dict:
    heads = hidden // 64
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(2, heads // 4), head_dim=64,
                intermediate_size=hidden * 8 // 3 // 64 * 64, vocab_size=vocab, max_position_embeddings=2048,
                rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu", torch_dtype=dtype,
                bos_token_id=1, eos_token_id=2)


def save_rank(cfg: dict, step_tmp: str, tp: int, dtype: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing

    from megarl.bridge import spec_from_dict
    from megarl.bridge.mapping import num_parameters
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    spec = spec_from_dict(cfg)
    model = build_gpt_model(spec, dtype=getattr(torch, dtype))
    # weights only (megatron's CPU optimizer takes no bfloat16 params, and the merge reads only the model)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "steps": 0}, str(Path(step_tmp) / "actor"))
    return {"params": num_parameters(spec)}


def _child(code: list) -> tuple:
    """Run a fresh python; (seconds, peak RSS bytes of that child alone (os.wait4), stderr)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable] + code, stdout=subprocess.DEVNULL, stderr=err, cwd=str(ROOT),
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        err.seek(0)
        text = err.read()
    if proc.returncode:
        raise RuntimeError(f"{code} failed:\n{text[-3000:]}")
    return seconds, usage.ru_maxrss * 1024, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-shard-size", default="2GB")
    ap.add_argument("--repeats", type=int, default=2, help="merge/copy rounds (best time, highest memory reported)")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory (removed at the end)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    from megarl.checkpoint.hf_import import finish_step_dir
    from megarl.launch_local import run_ranks

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_merge_"))
    cfg = spec_dict(args.hidden, args.layers, args.vocab, args.dtype)
    hf_cfg = work / "hf_config"
    hf_cfg.mkdir(parents=True, exist_ok=True)
    (hf_cfg / "config.json").write_text(json.dumps(cfg, indent=2))
    step = work / "run" / "checkpoints" / "step_0"
    tmp = Path(str(step) + ".tmp")
    shutil.rmtree(work / "run", ignore_errors=True)
    (tmp / "actor").mkdir(parents=True)
    t0 = time.perf_counter()
    params = run_ranks("bench.bench_merge:save_rank", args.tp, {"cfg": cfg, "step_tmp": str(tmp), "tp": args.tp,
                                                               "dtype": args.dtype}, timeout=None)[0]["params"]
    parallelism = {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": 1,
                   "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
                   "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None}
    finish_step_dir(tmp, "actor", hf_cfg, parallelism, args.tp, args.dtype)
    tmp.rename(step)
    save_s = time.perf_counter() - t0
    model_files = sorted((step / "actor").glob("*.distcp"))
    ckpt_bytes = sum(f.stat().st_size for f in model_files)

    # baseline RSS: the merge's imports, nothing merged
    _, base_rss, _ = _child(["-c", IMPORTS])
    out = work / "hf_out"
    copy_dir = work / "copy"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    copy_code = ("import shutil, sys, time\nfrom pathlib import Path\nt0 = time.perf_counter()\n"
                 "for f in sys.argv[2:]:\n    shutil.copyfile(f, Path(sys.argv[1]) / Path(f).name)\n"
                 "print(time.perf_counter() - t0, file=sys.stderr)\n")
    merge_s = merge_work_s = copy_s = copy_work_s = float("inf")
    merge_rss = 0
    for _ in range(args.repeats):  # merge and copy alternate; the best of each is kept (load from elsewhere varies)
        seconds, rss, err = _child(["-m", "megarl.checkpoint.merge_cli", "--ckpt", str(step), "--out", str(out),
                                    "--max-shard-size", args.max_shard_size, "--force", "--no-progress"])
        merge_s, merge_rss = min(merge_s, seconds), max(merge_rss, rss)
        # the merge's own time, without the interpreter and import start-up (the same for a 1 MB or a 1 TB model)
        _, _, work_err = _child(["-c", f"{IMPORTS}\nfrom megarl.checkpoint.merge import merge\nimport sys\n"
                                 "r = merge(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], force=True, "
                                 "progress=False)\nprint(r.seconds, file=sys.stderr)\n",
                                 str(step), str(out), args.max_shard_size])
        merge_work_s = min(merge_work_s, float(work_err.strip().splitlines()[-1]))
        seconds, _, copy_err = _child(["-c", copy_code, str(copy_dir)] + [str(f) for f in model_files])
        copy_s, copy_work_s = min(copy_s, seconds), min(copy_work_s, float(copy_err.strip().splitlines()[-1]))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    hf_bytes = index["metadata"]["total_size"]
    from megarl.bridge import Mapping, spec_from_dict

    spec = spec_from_dict(cfg)
    import math

    import torch

    esize = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    mapping = Mapping(spec)
    largest = max(math.prod(mapping.megatron_shape(e, 1)) for e in mapping.entries) * esize
    largest_hf = max(math.prod(s) for s in mapping.hf_shapes().values()) * esize


    result = {
        "params": params, "dtype": args.dtype, "tp": args.tp,
        "hf_bytes": hf_bytes, "checkpoint_model_bytes": ckpt_bytes, "save_s": round(save_s, 2),
        "merge_s": round(merge_s, 2), "merge_gb_per_s": round(hf_bytes / merge_s / 1e9, 3),
        "merge_gb_per_s_excl_startup": round(hf_bytes / merge_work_s / 1e9, 3),
        "copy_s": round(copy_s, 2), "copy_gb_per_s": round(ckpt_bytes / copy_s / 1e9, 3),
        "merge_vs_copy": round((hf_bytes / merge_s) / (ckpt_bytes / copy_s), 3),
        "merge_work_s": round(merge_work_s, 3), "copy_work_s": round(copy_work_s, 3),
        "merge_vs_copy_excl_startup": round((hf_bytes / merge_work_s) / (ckpt_bytes / copy_work_s), 3),
        "peak_rss_mb": round(merge_rss / 2 ** 20, 1), "baseline_rss_mb": round(base_rss / 2 ** 20, 1),
        "merge_rss_above_baseline_mb": round((merge_rss - base_rss) / 2 ** 20, 1),
        "largest_tensor_mb": round(largest / 2 ** 20, 1), "largest_hf_tensor_mb": round(largest_hf / 2 ** 20, 1),
        "rss_above_baseline_over_largest_tensor": round((merge_rss - base_rss) / largest, 2),
        "model_mb": round(hf_bytes / 2 ** 20, 1),
        "merge_log": err.strip().splitlines()[-1] if err.strip() else "",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
