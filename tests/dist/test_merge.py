"""`megarl merge`: a megarl checkpoint saved at any TP/PP/EP layout -> a Hugging Face model directory, on one
process, checked by transformers logprobs against the Megatron model that was saved (float32, within the derived
bound of tests/helpers/bounds.py: megatron and transformers round differently, on any kernel set).

The saving ranks load a tiny HF model, take one PPO step (so the weights differ from the HF source), save through
megarl's Checkpointer and return the logprobs (and critic values) of the trained model; the merge then runs in the
test process.
"""
import json
import shutil

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import logprob_bound, score_bound
from tests.helpers.tiny_models import hf_logprobs, hf_values, make_tiny_model, sample_tokens

LR, N, S = 1e-2, 4, 20


def save_rank(hf_dir, run_dir, batch, tp, pp, ep, etp=None, critic=False, vpp=None):
    import torch.distributed as dist

    from megarl.checkpoint.state import Checkpointer
    from megarl.config import MegarlConfig
    from megarl.config.schema import OptimConfig
    from megarl.megatron.forward import token_logprobs, token_values
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from megarl.runtime import Runtime

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp), seed=0)
    world, rank = dist.get_world_size(), dist.get_rank()
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    optim = OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0)
    actor = make_trainable(model, optim, total_steps=10)
    models = {"actor": actor}
    if critic:
        cmodel, _ = build_and_load(hf_dir, value_head=True, dtype=torch.float32)
        models["critic"] = make_trainable(cmodel, optim, total_steps=10)
    cfg = MegarlConfig.model_validate({
        "model": {"path": str(hf_dir)},
        "trainer": {"run_dir": str(run_dir), "n_gpus_per_node": world, "total_steps": 10},
        "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                        "virtual_pipeline_model_parallel_size": vpp, "expert_model_parallel_size": ep,
                        "expert_tensor_parallel_size": etp},
        "checkpoint": {"save_on_sigterm": False}})
    rt = Runtime(rank=rank, world_size=world, dp_rank=0, dp_size=1, run_dir=run_dir)
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    # virtual pipeline stages: a micro-batch count that is a multiple of PP (micro-batches of N / PP rows)
    mbs = N // pp if vpp else N
    micro = [{k: v[i:i + mbs] for k, v in batch.items()} for i in range(0, N, mbs)]
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    train_mini_batch(actor, micro, PolicyLoss(settings, denominator))
    ckpt = Checkpointer(cfg, rt, models=models, states={})
    ckpt.save(1)
    out = {"logprobs": token_logprobs(actor.chunks, batch["input_ids"], micro_batch_size=N)}
    if critic:
        out["values"] = token_values(models["critic"].chunks, batch["input_ids"], micro_batch_size=N)
    return out


def _batch(hf_dir, seed=3):
    tokens, lengths = sample_tokens(N, S, seed=seed, min_len=12)
    mask = torch.zeros(N, S - 1, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, 5: length - 1] = True
    adv = torch.randn(N, S - 1, generator=torch.Generator().manual_seed(5))
    return {"input_ids": tokens, "response_mask": mask, "old_log_probs": hf_logprobs(hf_dir, tokens), "advantages": adv}


def _train_and_save(root, arch, world, tp, pp, ep, etp=None, critic=True, seed=0):
    """Train `arch` one step on `world` ranks at the layout, save step_1; (hf_dir, batch, run_dir, last-stage result)."""
    hf_dir = make_tiny_model(arch, root / arch, seed=seed)
    batch = _batch(hf_dir)
    run_dir = root / "run"
    results = run_ranks(f"{__name__}:save_rank", world,
                        {"hf_dir": str(hf_dir), "run_dir": run_dir, "batch": batch, "tp": tp, "pp": pp, "ep": ep,
                         "etp": etp, "critic": critic}, timeout=600)
    return hf_dir, batch, run_dir, [r for r in results if r["logprobs"] is not None]


def _merge(run_dir, out, model="actor", **kw):
    from megarl.checkpoint.merge import merge

    return merge(run_dir, out, model=model, max_shard_size="100KB", progress=False, **kw)


def _masked_max(a, b, batch):
    mask = batch["input_ids"][:, 1:] != 0
    return (a - b).abs()[mask].max().item()


def _check_merged(root, saved, name):
    """Merge actor and critic; transformers' logprobs / values equal the saving megatron model's."""
    from tests.helpers.tiny_models import read_checkpoint

    hf_dir, batch, run_dir, last = saved
    tokens = batch["input_ids"]
    actor = _merge(run_dir, root / f"{name}_actor_hf")
    index = json.loads((actor.out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 100KB
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (actor.out / f).is_file(), f
    merged, source = read_checkpoint(actor.out), read_checkpoint(hf_dir)
    assert sorted(merged) == sorted(index["weight_map"]) == sorted(source)  # the same names as the HF architecture
    assert any(not torch.equal(merged[n], source[n]) for n in source)  # the trained weights, not the source
    got = hf_logprobs(actor.out, tokens)
    diff = max(_masked_max(got, r["logprobs"], batch) for r in last)
    tol = logprob_bound(actor.out, tokens, tokens[:, 1:] != 0)  # the merged (trained) model's own logits
    print(f"[merge {name}] actor: max |logprob diff| transformers vs megatron = {diff:.2e} (bound {tol:.2e})")
    assert diff < tol, (diff, tol)
    critic = _merge(run_dir, root / f"{name}_critic_hf", model="critic")
    cfg = json.loads((critic.out / "config.json").read_text())
    assert cfg["architectures"][0].endswith("ForSequenceClassification") and cfg["num_labels"] == 1
    assert "score.weight" in read_checkpoint(critic.out)
    got = hf_values(critic.out, tokens)
    diff = max((got - r["values"]).abs().max().item() for r in last)
    tol = score_bound(critic.out, got, tokens.shape[1])
    print(f"[merge {name}] critic: max |value diff| = {diff:.2e} (bound {tol:.2e})")
    assert diff < tol, (diff, tol)


@pytest.fixture(scope="module")
def moe_saved(tmp_path_factory):
    """qwen2_moe (shared experts, one dense layer, QKV bias) trained one step at TP2 x PP2 x EP2 (ETP1), 4 ranks."""
    root = tmp_path_factory.mktemp("merge_moe")
    return root, _train_and_save(root, "qwen2_moe", 4, tp=2, pp=2, ep=2, etp=1)


@pytest.mark.parity  # logprob parity: again under AVX2 kernels; the refusals and the bitwise reads below need not
def test_merge_moe_tp2_pp2_ep2_matches_megatron(moe_saved):
    root, saved = moe_saved
    meta = json.loads((saved[2] / "checkpoints" / "step_1" / "meta.json").read_text())
    assert meta["parallelism"]["expert_model_parallel_size"] == 2
    _check_merged(root, saved, "qwen2_moe_tp2pp2ep2")


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merge_dense_tp2_pp2_matches_megatron(tmp_path, arch):
    """Dense models at TP2 x PP2: llama (untied, llama3 rope, odd vocab), qwen2 (tied embeddings across stages)."""
    _check_merged(tmp_path, _train_and_save(tmp_path, arch, 4, tp=2, pp=2, ep=1), f"{arch}_tp2pp2")


# ---- refusals -------------------------------------------------------------------------------------------------------
@pytest.fixture
def ckpt_copy(moe_saved, tmp_path):
    """A private copy of the saved run (the refusal tests damage it)."""
    root, (hf_dir, batch, run_dir, last) = moe_saved
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy, copy / "checkpoints" / "step_1"


def test_missing_shard_file_is_refused_naming_it(ckpt_copy, tmp_path):
    from megarl.checkpoint.dcp_reader import CheckpointError

    run_dir, step = ckpt_copy
    victim = sorted((step / "actor").glob("*.distcp"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: missing"):
        _merge(run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_truncated_shard_file_is_refused_naming_it(ckpt_copy, tmp_path):
    from megarl.checkpoint.dcp_reader import CheckpointError

    run_dir, step = ckpt_copy
    victim = sorted((step / "actor").glob("*.distcp"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{victim.name}: truncated"):
        _merge(run_dir, tmp_path / "out")


def test_partial_checkpoint_is_refused(ckpt_copy, tmp_path):
    from megarl.checkpoint.dcp_reader import CheckpointError
    from megarl.checkpoint.merge import MergeError

    run_dir, step = ckpt_copy
    (step / "actor" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
        _merge(step, tmp_path / "out")
    partial = step.parent / "step_2.tmp"
    partial.mkdir()
    with pytest.raises(MergeError, match="incomplete checkpoint"):
        _merge(partial, tmp_path / "out")
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(MergeError, match="incomplete checkpoint"):
        _merge(step, tmp_path / "out")


def test_direct_chunk_reads_equal_torch_dcp_reads(moe_saved, tmp_path, monkeypatch):
    """The merger reads chunk bytes straight from the shard files; torch.distributed.checkpoint's own reader (the
    fallback for chunks not stored as plain torch.save records) must give byte-identical output files."""
    from megarl.checkpoint import dcp_reader

    root, (hf_dir, batch, run_dir, last) = moe_saved
    direct = _merge(run_dir, tmp_path / "direct", model="critic")
    monkeypatch.setattr(dcp_reader, "raw_data_offset", lambda *a, **k: None)
    via_torch = _merge(run_dir, tmp_path / "torch", model="critic")
    names = sorted(p.name for p in direct.out.iterdir())
    assert names == sorted(p.name for p in via_torch.out.iterdir()) and len(names) > 3
    assert all((direct.out / n).read_bytes() == (via_torch.out / n).read_bytes() for n in names)


@pytest.mark.parametrize("path", ["raw records", "torch's reader"])
def test_slice_reads_equal_torch_dcp_loads(moe_saved, monkeypatch, path):
    """Every tensor, and each expert of a layer's expert tensor alone, read by the merger's reader (from the chunks'
    raw bytes, or through torch's reader) equals that part of the whole tensor torch.distributed.checkpoint.load
    gives."""
    import torch.distributed.checkpoint as dcp

    from megarl.checkpoint import dcp_reader

    if path == "torch's reader":
        monkeypatch.setattr(dcp_reader, "raw_data_offset", lambda *a, **k: None)
    root, (hf_dir, batch, run_dir, last) = moe_saved
    model_dir = run_dir / "checkpoints" / "step_1" / "actor"
    ckpt = dcp_reader.DistCheckpoint(model_dir)
    keys = sorted(k for k in ckpt.tensors if not k.startswith("optimizer") and "_extra_state" not in k)
    whole = {k: torch.full(ckpt.shape(k), float("nan"), dtype=ckpt.dtype(k)) for k in keys}
    dcp.load(whole, checkpoint_id=str(model_dir), no_dist=True)
    experts = [k for k in keys if ".mlp.experts.experts." in k]
    assert experts and any(c.sizes[1] < ckpt.shape(k)[1] for k in experts for c in ckpt.tensors[k].chunks)  # TP too
    for key in keys:
        assert torch.equal(ckpt.read(key), whole[key]), key
    for key in experts:
        for e in range(ckpt.shape(key)[0]):
            assert torch.equal(ckpt.read(key, (e,)), whole[key][e]), (key, e)
    ckpt.close()


def test_nonempty_out_needs_force(moe_saved, tmp_path):
    from megarl.cli import main
    from megarl.checkpoint.merge import MergeError

    root, (hf_dir, batch, run_dir, last) = moe_saved
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MergeError, match="--force"):
        _merge(run_dir, out)
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["merge", "--ckpt", str(run_dir), "--out", str(out), "--no-progress"]) == 1
    assert main(["merge", "--ckpt", str(run_dir), "--out", str(out), "--no-progress", "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors.index.json").is_file()


def test_wrong_hf_config_is_refused_naming_tensors(moe_saved, tmp_path):
    from megarl.checkpoint.merge import MergeError

    root, (hf_dir, batch, run_dir, last) = moe_saved
    other = make_tiny_model("qwen3_moe", tmp_path / "other", tokenizer=False)
    with pytest.raises(MergeError, match="missing from the checkpoint|shape"):
        _merge(run_dir, tmp_path / "out", hf_config=other)


@pytest.mark.slow
def test_cli_verify_and_tools_wrapper(moe_saved, tmp_path):
    """`--verify` builds the megatron model from the checkpoint on one process and compares with transformers."""
    import subprocess
    import sys
    from pathlib import Path

    root, (hf_dir, batch, run_dir, last) = moe_saved
    tool = Path(__file__).resolve().parents[2] / "tools" / "merge_to_hf.py"
    proc = subprocess.run([sys.executable, str(tool), "--ckpt", str(run_dir), "--out", str(tmp_path / "o"),
                           "--verify", "--max-shard-size", "200KB"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verify: max |logprob diff|" in proc.stderr


# ---- import (HF -> dist checkpoint) and back ------------------------------------------------------------------------
@pytest.mark.slow
def test_import_then_merge_is_the_source_checkpoint(tmp_path):
    """`megarl import` at TP2 x PP2, then `megarl merge`: bitwise the HF tensors it started from."""
    from megarl.checkpoint.hf_import import import_hf
    from tests.helpers.tiny_models import read_checkpoint

    hf_dir = make_tiny_model("llama", tmp_path / "llama", seed=4)
    step = import_hf(hf_dir, tmp_path / "ckpt", tp=2, pp=2, dtype="float32")
    assert step.name == "step_0" and json.loads((step / "meta.json").read_text())["complete"] is True
    report = _merge(tmp_path / "ckpt", tmp_path / "back")
    merged, source = read_checkpoint(report.out), read_checkpoint(hf_dir)
    assert sorted(merged) == sorted(source)
    assert all(torch.equal(merged[n], source[n]) for n in source)
