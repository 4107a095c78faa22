"""Offloading the trainer's states around rollout (megarl.megatron.offload) on CPU: after one update, offload then
onload leaves every parameter, gradient buffer and optimizer state bitwise equal, the bytes it reports freed are the
bytes the storages no longer hold, and the next update equals the update of a model that was never offloaded."""
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_actor_step import CLIP_HIGH, CLIP_LOW, LR, N, setup  # noqa: F401 - setup is a fixture


def _update(trainable, spec, batch):
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.train_step import loss_denominator, train_mini_batch

    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, N, 2)]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    return train_mini_batch(trainable, micro, PolicyLoss(settings, loss_denominator(
        [m["response_mask"] for m in micro], settings.loss_agg_mode)))


def _snapshot(trainable) -> dict:
    from megarl.megatron.offload import category_tensors

    return {c: [t.detach().clone() for t in ts] for c, ts in category_tensors(trainable.chunks,
                                                                              trainable.optimizer).items()}


def offload_rank(hf_dir, batch, params, grads, optimizer):
    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.offload import StateOffloader, resident_bytes
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable

    init_model_parallel(Layout(), seed=0)
    out = {}
    runs = {}
    for name in ("offloaded", "kept"):
        model, spec = build_and_load(hf_dir, dtype=torch.float32)
        trainable = make_trainable(model, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0), total_steps=10)
        _update(trainable, spec, batch)
        runs[name] = (trainable, spec)
    trainable, spec = runs["offloaded"]
    before = _snapshot(trainable)
    resident = resident_bytes(trainable.chunks, trainable.optimizer)
    off = StateOffloader(trainable.chunks, trainable.optimizer, params=params, grads=grads, optimizer_states=optimizer)
    stats = off.offload()
    out["resident_before"], out["resident_offloaded"] = resident, resident_bytes(trainable.chunks, trainable.optimizer)
    out["offload"] = stats
    out["onload"] = off.onload()
    out["resident_after"] = resident_bytes(trainable.chunks, trainable.optimizer)
    after = _snapshot(trainable)
    out["bitwise"] = {c: all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                             for a, b in zip(before[c], after[c])) and len(before[c]) == len(after[c])
                      for c in before}
    out["counts"] = {c: len(v) for c, v in before.items()}
    out["numel"] = sum(p.numel() for p in {id(p): p for c in trainable.chunks for p in c.parameters()}.values())
    m_off = _update(trainable, spec, batch)
    m_kept = _update(*runs["kept"], batch)
    out["second_update_equal"] = (m_off["grad_norm"] == m_kept["grad_norm"]
                                  and all(torch.equal(a, b) for a, b in zip(runs["offloaded"][0].chunks[0].parameters(),
                                                                            runs["kept"][0].chunks[0].parameters())))
    return out


def test_offload_onload_is_bitwise_and_frees_what_it_says(setup):  # noqa: F811
    hf_dir, batch, _ = setup
    (r,) = run_ranks(f"{__name__}:offload_rank", 1, {"hf_dir": str(hf_dir), "batch": batch, "params": True,
                                                      "grads": True, "optimizer": True}, timeout=300)
    assert all(r["bitwise"].values()) and all(r["counts"].values()), r
    # fp32 on CPU: parameters (4 B), main_grad (4 B), Adam's two moments (8 B) per element, at least
    assert r["offload"]["bytes"] >= 16 * r["numel"], (r["offload"], r["numel"])
    assert r["offload"]["freed_bytes"] == r["offload"]["bytes"]
    assert r["resident_before"] - r["resident_offloaded"] == r["offload"]["freed_bytes"]
    assert r["resident_offloaded"] < 0.01 * r["resident_before"]  # only tiny tensors (Adam's step counter) remain
    assert r["resident_after"] == r["resident_before"] and r["onload"]["bytes"] == r["offload"]["bytes"]
    assert r["second_update_equal"]


def test_offload_of_the_optimizer_alone_keeps_parameters_and_grads(setup):  # noqa: F811
    hf_dir, batch, _ = setup
    (r,) = run_ranks(f"{__name__}:offload_rank", 1, {"hf_dir": str(hf_dir), "batch": batch, "params": False,
                                                      "grads": False, "optimizer": True}, timeout=300)
    assert all(r["bitwise"].values()) and r["second_update_equal"]
    # Adam's moments only (fp32 on CPU: the main params are the model's own, held by `params`)
    assert 8 * r["numel"] <= r["offload"]["bytes"] < 9 * r["numel"], (r["offload"], r["numel"])
    assert r["resident_before"] - r["resident_offloaded"] == r["offload"]["freed_bytes"]
