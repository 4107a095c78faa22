"""Training throughput of megarl's actor update (megatron-core forward/backward through train_mini_batch with the PPO
loss, then the optimizer step) in tokens/s and MFU, next to the same model and loss trained with plain torch (HF
transformers + torch.optim.AdamW) in the same run.

    python bench/bench_train.py                       # GPU: 1.1B at 2048 and 3B at 4096 tokens, bf16; CPU: a small one
    python bench/bench_train.py --sizes 1b --profile 10 --offload     # top-10 kernels and the offload round trip
    python bench/bench_train.py --sizes 1b --require-targets           # exit 1 when a speed target is short
    python bench/bench_train.py --hidden 2048 --layers 20 --seq 2048 --micro-batch 4 --micro-batches 2 --steps 5

Contenders: megarl with Transformer Engine ("megarl TE", its fusions on where their kernels are), megarl without TE
("megarl no TE": megatron's local spec with megarl's SDPA attention and RMSNorm in bf16), and plain torch. Sizes: 1b =
hidden 2048, 20 layers, 2 micro-batches of 4 x 2048 tokens; 3b = hidden 3072, 26 layers, 4 micro-batches of 1 x 4096.
Each row also gives the peak GPU memory allocated while it ran. Every model is created on the device it trains on.
`target:` lines give the speed targets (megarl no TE >= 1.0x plain torch; megarl TE >= 45% MFU at 1b), MET or SHORT
with the figure; --require-targets makes a short one exit 1. --offload times the round trip at one size only (its
pinned staging area is released after).

One process, TP1 (NCCL on GPU, gloo on CPU). MFU counts 6 * (matmul parameters) + 12 * layers * hidden * seq FLOPs
per token (forward and backward; causal masking not discounted) against --peak-tflops, by default the dense bf16 peak
of a known GPU (H100/H200: 989, A100: 312); on CPU MFU is printed only with --peak-tflops. The torch baseline keeps
fp32 parameters under bf16 autocast on GPU, the same mixed precision as megatron's bf16 with fp32 main params.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
# speed targets: the path without Transformer Engine at least as fast as plain torch; MFU with TE at 1.1B / 2048
NO_TE_VS_TORCH = 1.0
TE_MFU = {"1b": 0.45}


def model_config(hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // 128 if hidden >= 1024 else max(1, hidden // 64)
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=hidden * 8 // 3 // 64 * 64,
                vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_theta=10000.0, hidden_act="silu")


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B parameters" if params >= 1e9 else f"{params / 1e6:.1f}M parameters"


def flops_per_token(cfg: dict, seq: int) -> float:
    h, layers, ffn = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    matmul_params = layers * (4 * h * h + 3 * h * ffn) + h * cfg["vocab_size"]  # the input embedding is a lookup
    return 6.0 * matmul_params + 12.0 * layers * h * seq


def peak_tflops(requested) -> tuple:
    if requested:
        return requested, "given"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in PEAK_BF16_TFLOPS.items():
            if key in name:
                return value, f"{name} dense bf16"
    return None, "unknown: pass --peak-tflops"


def make_batch(n: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """A PPO mini-batch on the CPU, as the trainer holds it: every position after the first 8 is a response token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, seq - 1, dtype=torch.bool)
    mask[:, 8:] = True
    return {"input_ids": torch.randint(1, vocab, (n, seq), generator=g), "response_mask": mask,
            "old_log_probs": -torch.rand(n, seq - 1, generator=g) * 5,
            "advantages": torch.randn(n, seq - 1, generator=g)}


def _timed(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def megarl_contender(cfg: dict, batch: dict, micro_batch: int, warmup: int, steps: int, dtype: torch.dtype,
                     distributed_optimizer: bool, use_te: bool, profile: int = 0, offload: bool = False) -> dict:
    """megarl's actor update (train_mini_batch, PPO loss, optimizer step) timed; with `profile` the top GPU kernels of
    one step, with `offload` the round trip of its parameters, gradients and optimizer states to host memory."""
    from megarl.bridge import spec_from_dict
    from megarl.config.schema import OptimConfig
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch

    spec = spec_from_dict(cfg)
    _reset_peak()
    model = build_gpt_model(spec, dtype=dtype, use_te=use_te)
    if torch.cuda.is_available():
        model.cuda()
    fusions = ", ".join(k.replace("_fusion", "").replace("apply_", "") for k, (on, _) in model.megarl_fusions.items()
                        if on) or "none"
    attention = type(model.decoder.layers[0].self_attention.core_attention).__name__
    trainable = make_trainable(model, OptimConfig(lr=1e-6, weight_decay=0.0), total_steps=warmup + steps + 2,
                               use_distributed_optimizer=distributed_optimizer)
    rows = range(0, len(batch["input_ids"]), micro_batch)
    micro = [{k: v[i:i + micro_batch] for k, v in batch.items()} for i in rows]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    loss_fn = PolicyLoss(settings, denominator)
    step = lambda: train_mini_batch(trainable, micro, loss_fn)  # noqa: E731
    out = {"seconds": _timed(step, warmup, steps), "peak": _peak(), "detail": f"{attention}; fusions: {fusions}"}
    if profile:
        out["kernels"] = _profile(step, profile)
    if offload:
        out["offload"] = _offload_round_trip(trainable)
    del trainable, model, step
    _free()
    return out


def _offload_round_trip(trainable) -> dict:
    """Offload parameters, gradient buffers and optimizer states to pinned host memory and back (timed), with a
    per-tensor checksum before and after."""
    from megarl.megatron.offload import StateOffloader, category_tensors

    def checksums():
        return [t.detach().float().sum().item() for ts in category_tensors(trainable.chunks, trainable.optimizer)
                .values() for t in ts]

    before = checksums()
    allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    off = StateOffloader(trainable.chunks, trainable.optimizer)
    down = off.offload()
    allocated_off = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    up = off.onload()
    staging = off.staging_bytes()
    off.release()  # the pinned host memory goes back now, not when the process ends
    return {"bytes": down["bytes"], "offload_s": down["seconds"], "onload_s": up["seconds"],
            "freed": down["freed_bytes"], "allocated_freed": allocated - allocated_off, "staging": staging,
            "unchanged": before == checksums()}


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profile(step, top: int) -> list:
    """[(kernel, share of the step's GPU time, ms)] of one step, largest first (CPU: operators by CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) if cuda else evt.self_cpu_time_total
        if cuda and not t:
            t = getattr(evt, "cuda_time_total", 0)
        if t and (not cuda or evt.device_type.name == "CUDA"):
            times[evt.key] = times.get(evt.key, 0) + t
    total = sum(times.values()) or 1
    return [(k, v / total, v / 1e3) for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:top]]


def torch_contender(cfg: dict, batch: dict, micro_batch: int, warmup: int, steps: int, dtype: torch.dtype,
                    profile: int = 0) -> dict:
    """The same update with HF transformers and plain torch: gradient accumulation over the micro-batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl import algo

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    _reset_peak()
    with device:  # the weights are created on the device: initialising 3B on the CPU first takes minutes
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    micro = [{k: v[i:i + micro_batch].to(device) for k, v in batch.items()}
             for i in range(0, len(batch["input_ids"]), micro_batch)]
    total = sum(float(m["response_mask"].sum()) for m in micro)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        opt.zero_grad(set_to_none=True)
        for m in micro:
            with autocast:
                logits = model(input_ids=m["input_ids"]).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, m["input_ids"][:, 1:, None]).squeeze(-1)
            loss, _ = algo.ppo_clip_loss(m["old_log_probs"], lp, m["advantages"], m["response_mask"], "token-mean",
                                         0.2, 0.2, 3.0)
            (loss * float(m["response_mask"].sum()) / total).backward()
        opt.step()

    out = {"seconds": _timed(step, warmup, steps), "peak": _peak(),
           "detail": f"attention {model.config._attn_implementation}"}
    if profile:
        out["kernels"] = _profile(step, profile)
    del model, opt, step
    _free()
    return out


SIZES = {  # the two sizes: name -> (hidden, layers, vocab, seq, micro-batch, micro-batches)
    "1b": (2048, 20, 32000, 2048, 4, 2),
    "3b": (3072, 26, 32000, 4096, 1, 4),
    "cpu": (256, 4, 2048, 128, 2, 2),
}


def run_size(name: str, shape: tuple, args, contenders: list, dtype: torch.dtype) -> list:
    """Benchmark one size; returns the speed targets it fell short of."""
    from megarl.bridge import spec_from_dict
    from megarl.bridge.mapping import num_parameters

    hidden, layers, vocab, seq, mb, n_mb = shape
    cfg = model_config(hidden, layers, vocab)
    params = num_parameters(spec_from_dict(cfg))
    batch = make_batch(mb * n_mb, seq, vocab)
    tokens = batch["input_ids"].numel()
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"\n[{name}] Llama-like model: hidden {hidden}, {layers} layers, vocab {vocab}: {_count(params)} "
          f"{args.dtype}; {n_mb} micro-batches of {mb} x {seq} tokens per step on {device}")
    peak, peak_source = peak_tflops(args.peak_tflops)
    flops = flops_per_token(cfg, seq)
    rows = []
    for c in contenders:
        label = {"te": "megarl TE", "no-te": "megarl no TE", "torch": "plain torch (HF + AdamW)"}[c]
        try:
            if c == "torch":
                r = torch_contender(cfg, batch, mb, args.warmup, args.steps, dtype, args.profile)
            else:
                r = megarl_contender(cfg, batch, mb, args.warmup, args.steps, dtype, args.distributed_optimizer,
                                     use_te=c == "te", profile=args.profile,
                                     offload=args.offload == name and c == contenders[0])
        except torch.OutOfMemoryError:
            _free()
            print(f"{label}: out of GPU memory at this size")
            continue
        rows.append((label, r))
    base = next((r["seconds"] for label, r in rows if label.startswith("plain torch")), None)
    print(f"{'trainer':<26} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'vs torch':>9} {'peak GiB':>9}")
    for label, r in rows:
        tps = tokens / r["seconds"]
        tflops = tps * flops / 1e12
        mfu = f"{tflops / peak:.1%}" if peak else "n/a"
        ratio = f"{base / r['seconds']:.2f}x" if base else "n/a"
        print(f"{label:<26} {r['seconds']:>8.3f} {tps:>10.0f} {tflops:>8.3f} {mfu:>6} {ratio:>9} {r['peak']:>9.1f}")
    print(f"MFU peak: {f'{peak:g} TFLOP/s' if peak else 'n/a'} ({peak_source}); {flops / 1e9:.2f} GFLOP per token")
    for label, r in rows:
        print(f"  {label}: {r['detail']}")
        for kernel, share, ms in r.get("kernels", []):
            print(f"    {share:6.1%} {ms:9.2f} ms  {kernel[:110]}")
        if "offload" in r:
            o = r["offload"]
            print(f"  offload round trip ({label}, parameters + gradient buffers + optimizer states): "
                  f"{o['bytes'] / 2 ** 20:.1f} MiB to host memory in {o['offload_s']:.3f} s "
                  f"({o['bytes'] / max(o['offload_s'], 1e-9) / 1e9:.1f} GB/s), back in {o['onload_s']:.3f} s "
                  f"({o['bytes'] / max(o['onload_s'], 1e-9) / 1e9:.1f} GB/s); device memory freed "
                  f"{o['freed'] / 2 ** 20:.1f} MiB (reserved), {o['allocated_freed'] / 2 ** 20:.1f} MiB (allocated); "
                  f"host staging {o['staging'] / 2 ** 20:.1f} MiB (released after); states unchanged: {o['unchanged']}")
    short = []
    by_label = dict(rows)
    if "megarl no TE" in by_label and base:
        ratio = base / by_label["megarl no TE"]["seconds"]
        short += _target(f"megarl no TE >= {NO_TE_VS_TORCH:.2f}x plain torch [{name}]", ratio >= NO_TE_VS_TORCH,
                         f"{ratio:.2f}x")
    if "megarl TE" in by_label and peak and name in TE_MFU:
        mfu = tokens / by_label["megarl TE"]["seconds"] * flops / 1e12 / peak
        short += _target(f"megarl TE MFU >= {TE_MFU[name]:.0%} [{name}]", mfu >= TE_MFU[name], f"{mfu:.1%}")
    return short


def _target(what: str, met: bool, figure: str) -> list:
    print(f"target: {what}: {'MET' if met else 'SHORT'} ({figure})")
    return [] if met else [what]


def main(argv=None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1b,3b" if gpu else "cpu",
                   help=f"comma-separated sizes from {sorted(SIZES)} (ignored when --hidden is given)")
    p.add_argument("--hidden", type=int, default=None, help="a custom size (with --layers, --vocab, --seq, ...)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5 if gpu else 2)
    p.add_argument("--warmup", type=int, default=2 if gpu else 1)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16" if gpu else "float32")
    p.add_argument("--contenders", default=None, help="comma-separated from te, no-te, torch (default: te when "
                   "Transformer Engine is available, no-te, torch)")
    p.add_argument("--distributed-optimizer", action="store_true", help="megatron's distributed optimizer (GPU only)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU")
    p.add_argument("--skip-torch", action="store_true", help="no plain-torch baseline (e.g. when memory is short)")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="print the top K kernels of one profiled step")
    p.add_argument("--offload", nargs="?", const="first", default=None, metavar="SIZE",
                   help="time the offload round trip of the first megarl contender's states (parameters, gradient "
                   "buffers, optimizer states) to pinned host memory, at one size: SIZE, or the first of --sizes")
    p.add_argument("--require-targets", action="store_true", help="exit 1 when a speed target is short (megarl "
                   f"no TE >= {NO_TE_VS_TORCH:g}x plain torch; megarl TE MFU at 1b >= {TE_MFU['1b']:.0%})")
    args = p.parse_args(argv)

    from megarl.megatron.model import te_available
    from megarl.distributed import init_distributed
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_distributed()
    init_model_parallel(Layout(), seed=0)
    contenders = (args.contenders.split(",") if args.contenders else
                  (["te"] if te_available() else []) + ["no-te", "torch"])
    if args.skip_torch:
        contenders = [c for c in contenders if c != "torch"]
    if "te" in contenders and not te_available():
        p.error("--contenders te needs CUDA and Transformer Engine")
    dtype = getattr(torch, args.dtype)
    if args.hidden:
        sizes = {"custom": (args.hidden, args.layers, args.vocab, args.seq, args.micro_batch, args.micro_batches)}
    else:
        sizes = {name: SIZES[name] for name in args.sizes.split(",")}
    if args.offload == "first":
        args.offload = next(iter(sizes))
    elif args.offload is not None and args.offload not in sizes:
        p.error(f"--offload {args.offload}: not one of the sizes run ({', '.join(sizes)}); give one of them")
    short = []
    for name, shape in sizes.items():
        short += run_size(name, shape, args, contenders, dtype)
    from megarl.megatron.parallel import destroy

    destroy()
    if short and args.require_targets:
        print(f"error: speed targets short: {'; '.join(short)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
