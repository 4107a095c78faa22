"""Training steps on megatron-core: optimizer and LR schedule, and the thin adapter from pure losses to megatron.

The losses in megarl.algo are pure functions of tensors. Megatron's schedule (get_forward_backward_func) wants a
forward-step function returning (output, loss_func), where loss_func(output) -> (loss, metrics); it divides each
micro-batch loss by the number of micro-batches, and DDP averages gradients over data-parallel ranks. To make the
gradient exactly that of the loss over the whole mini-batch (all micro-batches, all DP ranks), every micro-batch
computes its loss with the *global* denominator (tokens or sequences of the mini-batch across DP ranks) and returns
it multiplied by num_microbatches * dp_size, which cancels megatron's two averages. Under context parallelism megatron
also multiplies each loss by CP and DDP averages over the data-parallel x CP group; every CP rank computes the whole
loss and back-propagates through its own tokens only (megarl.megatron.context_parallel), so those two cancel as well.

A micro-batch is a dict of tensors with a leading batch dimension: at least `input_ids` [b, S] (right padded; real
lengths from `response_mask` or `lengths`, see megarl.megatron.packing.row_lengths). It runs packed: the loss function
receives it with its pack under "pack", and the model output of the pack ([1, P, V/TP] logits, or [1, P, 1] values for
a critic); megarl.megatron.packing's row_logprobs / row_entropy / row_values give [b, ...] per row.
Micro-batches arrive on the CPU; the forward step moves each to the runtime's compute device just before the model, and
every tensor a collective sees is on that device too (megarl.distributed checks both).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from megarl import distributed
from megarl.config.schema import OptimConfig
from megarl.megatron import router_replay

LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict]]
PACK_SIZE = "pack_size"  # a micro-batch's pack length as the expert-parallel ranks agreed on it (packing.agreed_sizes)


@dataclass
class Trainable:
    """A model wrapped for training: megatron DDP chunks, its optimizer and LR scheduler."""

    chunks: list  # DDP-wrapped GPTModel chunks (one per virtual pipeline stage)
    optimizer: object
    scheduler: object
    steps: int = 0
    last_lr: float = field(default=0.0)


def make_trainable(model, optim: OptimConfig, total_steps: int, use_distributed_optimizer: bool = False) -> Trainable:
    """Wrap `model` (a GPTModel or list of chunks) in megatron DDP and build its optimizer and LR schedule."""
    if optim.lr_warmup_steps >= max(1, total_steps):  # megatron's scheduler asserts this without a message
        raise ValueError(f"optim.lr_warmup_steps = {optim.lr_warmup_steps}: warm-up must end before the last of the "
                         f"run's {max(1, total_steps)} optimizer steps; lower the warm-up or run more steps")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    chunks = model if isinstance(model, (list, tuple)) else [model]
    config = chunks[0].config
    if use_distributed_optimizer and not torch.cuda.is_available():
        raise ValueError("parallelism.use_distributed_optimizer=true needs CUDA (megatron's distributed optimizer does "
                         "not run on CPU); set it to false")
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               overlap_grad_reduce=False, grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    for c in wrapped:
        c.broadcast_params()  # identical DP replicas even if a rank's initialisation drifted
    config.finalize_model_grads_func = finalize_model_grads
    dtype = config.params_dtype
    opt_config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, wrapped)
    decay_steps = max(1, total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
    return Trainable(wrapped, optimizer, scheduler)


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def global_count(local: torch.Tensor) -> torch.Tensor:
    """Sum of a local count over data-parallel ranks (the denominator every micro-batch divides by), on the compute
    device."""
    total = local.detach().to(device=distributed.compute_device(), dtype=torch.float64, copy=True)
    distributed.all_reduce(total, group=_dp_group())
    return total


def loss_denominator(masks: list[torch.Tensor], loss_agg_mode: str) -> torch.Tensor:
    """Global count for `loss_agg_mode`: valid tokens (token-mean) or sequences with a valid token (seq-mean-*).

    masks: the response masks [b, T] of this rank's micro-batches of one mini-batch."""
    if loss_agg_mode == "token-mean":
        local = sum(m.sum() for m in masks)
    else:
        local = sum((m.sum(dim=-1) > 0).sum() for m in masks)
    return global_count(torch.as_tensor(local))


def train_mini_batch(trainable: Trainable, micro_batches: list[dict], loss_fn: LossFn) -> dict:
    """One optimizer step over `micro_batches` (this rank's share of a mini-batch). Returns metrics.

    loss_fn(micro_batch, model_output) -> (loss, metrics) must already divide by the global denominator; this
    function scales it for megatron's averaging. Metrics are averaged over micro-batches and DP ranks, except keys
    ending in "loss", which are summed over micro-batches (they are shares of the global mini-batch loss) and DP.
    Every rank of the model-parallel group must pass the same micro-batches.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.megatron.parallel import schedule_args

    from megarl.megatron.forward import pack_size_for, schedule_shapes, shares
    from megarl.megatron.packing import agreed_sizes, row_lengths

    n_micro = len(micro_batches)
    dp = ps.get_data_parallel_world_size()
    scale = float(n_micro * dp)
    config = trainable.chunks[0].config
    share = shares(trainable.chunks)
    sizes, shapes = schedule_shapes(trainable.chunks, agreed_sizes([
        pack_size_for(config, row_lengths(mb), mb["input_ids"] if share else None) for mb in micro_batches]))
    micro_batches = [{**mb, PACK_SIZE: size} for mb, size in zip(micro_batches, sizes)]

    for chunk in trainable.chunks:
        chunk.zero_grad_buffer()
    trainable.optimizer.zero_grad()
    results = get_forward_backward_func()(
        forward_step_func=partial(forward_step, loss_fn, scale), **schedule_args(trainable.chunks, micro_batches),
        num_microbatches=n_micro, forward_only=False, **shapes)
    update_ok, grad_norm, _ = trainable.optimizer.step()
    trainable.scheduler.step(increment=1)
    trainable.steps += 1
    metrics = _reduce_metrics(results, n_micro)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["update_skipped"] = float(not update_ok)
    metrics["lr"] = trainable.optimizer.param_groups[0]["lr"]
    metrics["pack_tokens"] = float(sum(sizes))  # tokens this rank computed for the step (shared prefixes once)
    return metrics


def forward_step(loss_fn: LossFn, scale: float, data_iterator, model):
    """Megatron's forward-step contract for one training micro-batch: (output, loss_func) with the loss scaled by
    `scale` (see the module docstring) and its metrics as float tensors. The micro-batch runs packed; the loss
    function finds the pack as mb["pack"] (megarl.megatron.packing)."""
    from megarl.megatron.forward import pack_for, packed_forward, shares
    from megarl.megatron.packing import row_lengths

    host = next(data_iterator)
    lengths = row_lengths(host)  # the pack's layout comes from the host copy: no read-back from the device
    mb = distributed.to_device(host)
    pack = pack_for(getattr(model, "config", None), mb["input_ids"], lengths, host.get(PACK_SIZE), shares(model))
    # routing replay reads the rows' global ids (row_index)
    rows = mb["row_index"].cpu() if router_replay.STATE.action != "off" else None
    # a vision-language model's rows carry their images (megarl.batching.VISION_KEYS)
    vision = {k: mb[k] for k in ("pixel_values", "image_grid_thw") if k in mb} or None
    output = packed_forward(model, pack, rows, vision)
    return output, partial(_scaled_loss, loss_fn, scale, {**mb, "pack": pack})


def _scaled_loss(loss_fn: LossFn, scale: float, mb: dict, output: torch.Tensor):
    loss, metrics = loss_fn(mb, output)
    return loss * scale, {k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}


def _reduce_metrics(results: list[dict], n_micro: int) -> dict:
    """Average (or, for *loss keys, sum) metrics over micro-batches; then over DP; shared from the last PP stage."""
    from megatron.core import parallel_state as ps

    keys = sorted(results[0]) if results else []
    # every pipeline stage must agree on the keys: the last stage (the only one with results) sends them
    last, pp_group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        keys = distributed.broadcast_strings(keys, src=last, group=pp_group)
    values = torch.zeros(len(keys), dtype=torch.float64, device=distributed.compute_device())
    if results:
        # one stack on the device: no per-metric transfer
        totals = torch.stack([sum(r[k].double().to(values.device) for r in results) for k in keys])
        scale = torch.tensor([1.0 if k.endswith("loss") else 1.0 / n_micro for k in keys], dtype=torch.float64)
        values = totals * scale.to(values.device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        distributed.broadcast(values, src=last, group=pp_group)
    distributed.all_reduce(values, group=ps.get_data_parallel_group())
    dp = ps.get_data_parallel_world_size()
    host = values.tolist()  # the step's one synchronisation for metrics
    return {k: host[i] if k.endswith("loss") else host[i] / dp for i, k in enumerate(keys)}
