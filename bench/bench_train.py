"""Training throughput of megarl's actor update (megatron-core forward/backward through train_mini_batch with the PPO
loss, then the optimizer step) in tokens/s and MFU, next to the same model and loss trained with plain torch (HF
transformers + torch.optim.AdamW) in the same run.

    python bench/bench_train.py            # GPU: a 1.1B Llama-like model in bf16 (fp32 main params); CPU: a small one
    python bench/bench_train.py --hidden 2048 --layers 20 --seq 2048 --micro-batch 4 --micro-batches 2 --steps 5

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


def megarl_step_seconds(cfg: dict, batch: dict, micro_batch: int, warmup: int, steps: int, dtype: torch.dtype,
                        distributed_optimizer: bool) -> float:
    from megarl.bridge import spec_from_dict
    from megarl.config.schema import OptimConfig
    from megarl.megatron.losses import PolicyLossSettings, make_policy_loss_fn
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch

    spec = spec_from_dict(cfg)
    model = build_gpt_model(spec, dtype=dtype)
    if torch.cuda.is_available():
        model.cuda()
    trainable = make_trainable(model, OptimConfig(lr=1e-6, weight_decay=0.0), total_steps=warmup + steps,
                               use_distributed_optimizer=distributed_optimizer)
    rows = range(0, len(batch["input_ids"]), micro_batch)
    micro = [{k: v[i:i + micro_batch] for k, v in batch.items()} for i in rows]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    loss_fn = make_policy_loss_fn(settings, denominator)
    seconds = _timed(lambda: train_mini_batch(trainable, micro, loss_fn), warmup, steps)
    del trainable, model
    return seconds


def torch_step_seconds(cfg: dict, batch: dict, micro_batch: int, warmup: int, steps: int, dtype: torch.dtype) -> float:
    """The same update with HF transformers and plain torch: gradient accumulation over the micro-batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl import algo

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).to(device)
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

    seconds = _timed(step, warmup, steps)
    del model, opt
    return seconds


def main(argv=None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048 if gpu else 256)
    p.add_argument("--layers", type=int, default=20 if gpu else 4)
    p.add_argument("--vocab", type=int, default=32000 if gpu else 2048)
    p.add_argument("--seq", type=int, default=2048 if gpu else 128)
    p.add_argument("--micro-batch", type=int, default=4 if gpu else 2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5 if gpu else 2)
    p.add_argument("--warmup", type=int, default=2 if gpu else 1)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16" if gpu else "float32")
    p.add_argument("--distributed-optimizer", action="store_true", help="megatron's distributed optimizer (GPU only)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU")
    p.add_argument("--skip-torch", action="store_true", help="no plain-torch baseline (e.g. when memory is short)")
    args = p.parse_args(argv)

    from megarl.bridge import spec_from_dict
    from megarl.megatron.parallel import Layout, init_distributed, init_model_parallel

    init_distributed()
    init_model_parallel(Layout(), seed=0)
    cfg = model_config(args.hidden, args.layers, args.vocab)
    params = spec_from_dict(cfg).num_parameters()
    dtype = getattr(torch, args.dtype)
    batch = make_batch(args.micro_batch * args.micro_batches, args.seq, args.vocab)
    tokens = batch["input_ids"].numel()
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"Llama-like model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {_count(params)} "
          f"{args.dtype}; {args.micro_batches} micro-batches of {args.micro_batch} x {args.seq} tokens "
          f"per step on {device}")
    peak, peak_source = peak_tflops(args.peak_tflops)
    flops = flops_per_token(cfg, args.seq)
    rows = [("megarl (megatron-core)", megarl_step_seconds(cfg, batch, args.micro_batch, args.warmup, args.steps, dtype,
                                                           args.distributed_optimizer))]
    if gpu:
        torch.cuda.empty_cache()
    if not args.skip_torch:
        rows.append(("plain torch (HF + AdamW)", torch_step_seconds(cfg, batch, args.micro_batch, args.warmup,
                                                                    args.steps, dtype)))
    print(f"{'trainer':<26} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'vs torch':>9}")
    for name, seconds in rows:
        tps = tokens / seconds
        tflops = tps * flops / 1e12
        mfu = f"{tflops / peak:.1%}" if peak else "n/a"
        ratio = f"{rows[-1][1] / seconds:.2f}x" if len(rows) > 1 else "n/a"
        print(f"{name:<26} {seconds:>8.3f} {tps:>10.0f} {tflops:>8.3f} {mfu:>6} {ratio:>9}")
    print(f"MFU peak: {f'{peak:g} TFLOP/s' if peak else 'n/a'} ({peak_source}); {flops / 1e9:.2f} GFLOP per token")
    from megarl.megatron.parallel import destroy

    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
