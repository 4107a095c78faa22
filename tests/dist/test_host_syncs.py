"""Host synchronisations per training step: a handful, independent of the number of micro-batches and of parameter
tensors. Counted by patching every Tensor method that waits for the device (item, tolist, cpu, numpy, nonzero, bool,
float, int) during one train_mini_batch of a tiny model. Excluded: torch.optim reading its `step` counters, which
torch keeps on the host (no device wait on a GPU either), and the reads of host data that packing does (no device
wait either): the pack's layout from the micro-batch's host copy (micro-batches arrive on the CPU) and megatron's
unfused rope reading the pack's boundaries, which stay on the host without TE."""
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_actor_step import CLIP_HIGH, CLIP_LOW, N, setup  # noqa: F401 - setup is a fixture

METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__")
HOST_READS = {("packing.py", "row_lengths"), ("packing.py", "pack_rows"), ("packing.py", "pack_size"),
              ("rope_utils.py", "_apply_rotary_pos_emb_thd")}


def count_rank(hf_dir, batch, micro_sizes):
    import traceback
    from collections import Counter

    from megarl.config.schema import OptimConfig
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch

    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    trainable = make_trainable(model, OptimConfig(lr=1e-4), total_steps=10)
    settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    out = {}
    for size in [micro_sizes[0]] + list(micro_sizes):  # the first step creates optimizer state: not counted
        micro = [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, N, size)]
        loss_fn = PolicyLoss(settings, loss_denominator([m["response_mask"] for m in micro], "token-mean"))
        counts, originals = Counter(), {m: getattr(torch.Tensor, m) for m in METHODS}

        def patched(name):
            def call(self, *a, **k):
                site = traceback.extract_stack(limit=3)[-2]
                if "/torch/optim/" not in site.filename and (site.filename.rsplit("/", 1)[-1],
                                                             site.name) not in HOST_READS:
                    counts[f"{name} at {site.filename.rsplit('/', 3)[-1]}:{site.lineno}"] += 1
                return originals[name](self, *a, **k)
            return call

        for name in METHODS:
            setattr(torch.Tensor, name, patched(name))
        try:
            train_mini_batch(trainable, micro, loss_fn)
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
        out[len(micro)] = dict(counts)
    return out


def test_a_training_step_synchronises_with_the_host_a_handful_of_times(setup):  # noqa: F811
    hf_dir, batch, _ = setup
    (r,) = run_ranks(f"{__name__}:count_rank", 1, {"hf_dir": str(hf_dir), "batch": batch, "micro_sizes": [2, 1]},
                     timeout=300)
    totals = {n: sum(c.values()) for n, c in r.items()}
    assert set(totals) == {2, 4}
    for n, c in r.items():
        assert totals[n] <= 3, (n, c)  # gradient norm, metrics (and nothing per micro-batch or per parameter)
    assert totals[2] == totals[4], r
