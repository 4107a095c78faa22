"""Critic (value head) from HF models, the export stream's contract, and import errors through build_and_load."""
import json
import shutil

import pytest

from megarl.launch_local import run_ranks
from tests.helpers.bounds import score_bound
from tests.helpers.tiny_models import hf_values, make_tiny_model, read_checkpoint, sample_tokens

SEQ, N = 16, 3


# ---- critic ---------------------------------------------------------------------------------------------------------
def critic_rank(dirs: dict, tokens):
    """TP=2: values of each critic, the head's gradient of sum(values), and whether every parameter got a gradient."""
    import torch

    from megarl.bridge import export_to_dict
    from megarl.megatron.forward import causal_inputs, token_values
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=2), seed=5)
    out = {}
    for name, hf_dir in dirs.items():
        model, spec = build_and_load(hf_dir, value_head=True)
        values = token_values(model, tokens, micro_batch_size=N)
        pos, mask = causal_inputs(tokens)
        pred = model(tokens, pos, mask)  # [B, S, 1]
        pred.sum().backward()
        no_grad = [n for n, p in model.named_parameters() if p.grad is None]
        exported = export_to_dict(model, spec)
        out[name] = dict(values=values, shape=tuple(pred.shape), head_grad=model.output_layer.weight.grad.clone(),
                         head=model.output_layer.weight.detach().clone(), no_grad=no_grad,
                         initialised=model.megarl_load_report["initialised"], exported=exported)
    return out


@pytest.fixture(scope="module")
def critics(tmp_path_factory):
    root = tmp_path_factory.mktemp("critics")
    dirs = {"qwen2_rm": str(make_tiny_model("qwen2", root / "qwen2_rm", head="value", seed=11, tokenizer=False)),
            "qwen3_moe_rm": str(make_tiny_model("qwen3_moe", root / "q3m_rm", head="value", seed=12, tokenizer=False)),
            "llama_lm": str(make_tiny_model("llama", root / "llama_lm", seed=13, tokenizer=False))}
    tokens, _ = sample_tokens(N, SEQ, seed=4)
    return dirs, tokens, run_ranks(f"{__name__}:critic_rank", 2, {"dirs": dirs, "tokens": tokens}, timeout=600)


@pytest.mark.parity
@pytest.mark.parametrize("name", ["qwen2_rm", pytest.param("qwen3_moe_rm", marks=pytest.mark.parity_repeat)])
def test_critic_from_hf_value_model_matches_hf(critics, name):
    """A *ForSequenceClassification checkpoint: values [B, S] equal HF's score head on every token; gradients flow
    (qwen3_moe at TP2 runs with sequence parallelism, exercising the head's gather)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    dirs, tokens, results = critics
    ref = hf_values(dirs[name], tokens)
    tol = score_bound(dirs[name], ref, SEQ)
    hf = AutoModelForSequenceClassification.from_pretrained(dirs[name], dtype=torch.float32, attn_implementation="eager")
    hidden = hf.model(input_ids=tokens).last_hidden_state
    hf.score(hidden).sum().backward()
    # the head's gradient of sum(values) is each hidden unit summed over the N x SEQ positions: a linear read-out of
    # the last hidden state whose scale per unit is the norm of that unit over the positions
    grad_tol = score_bound(dirs[name], hidden.detach().pow(2).sum((0, 1)).sqrt(), SEQ)
    for r in results:
        got = r[name]
        assert got["shape"] == (N, SEQ, 1) and got["values"].shape == (N, SEQ)
        diff = (got["values"] - ref).abs().max().item()
        grad_diff = (got["head_grad"] - hf.score.weight.grad).abs().max().item()
        print(f"[critic {name}] max |value diff| = {diff:.2e} (bound {tol:.2e}); max |head grad diff| = "
              f"{grad_diff:.2e} (bound {grad_tol:.2e})")
        assert diff < tol, (diff, tol)
        assert got["initialised"] == [] and got["no_grad"] == []
        assert grad_diff < grad_tol, (grad_diff, grad_tol)
        assert sorted(got["exported"]) == sorted(read_checkpoint(dirs[name]))  # score.weight, no lm_head
        assert torch.equal(got["exported"]["score.weight"], read_checkpoint(dirs[name])["score.weight"])


def test_critic_from_causal_lm_initialises_the_head(critics):
    import torch

    dirs, tokens, results = critics
    h = 128
    expected = torch.randn(1, h, generator=torch.Generator().manual_seed(0)) / (h + 1)  # documented in model.py
    for r in results:
        got = r["llama_lm"]
        assert got["initialised"] == ["output_layer.weight"]
        assert torch.equal(got["head"], expected)
        assert got["values"].shape == (N, SEQ) and torch.isfinite(got["values"]).all()
        assert got["no_grad"] == []
        assert "score.weight" in got["exported"] and "lm_head.weight" not in got["exported"]


# ---- export stream contract ----------------------------------------------------------------------------------------
BUCKET = 48 << 10


def export_rank(dirs: dict):
    """TP2 x PP2: the stream to every rank (identical), and to rank 3 only (others get empty buckets in step)."""
    import torch.distributed as dist

    from megarl.bridge import export_hf_weights
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), seed=5)
    out = {}
    for name, hf_dir in dirs.items():
        model, spec = build_and_load(hf_dir)
        everyone = [[(n, tuple(t.shape), t.numel() * t.element_size()) for n, t in b]
                    for b in export_hf_weights(model, spec, bucket_bytes=BUCKET)]
        to_three = [dict(b) for b in export_hf_weights(model, spec, bucket_bytes=BUCKET, dst_rank=3)]
        out[name] = dict(everyone=everyone, to_three=to_three, rank=dist.get_rank(), load=model.megarl_load_report)
    return out


def test_export_stream_contract(tmp_path):
    import torch

    dirs = {"llama": str(make_tiny_model("llama", tmp_path / "llama", seed=1, tokenizer=False)),
            "qwen2_tied": str(make_tiny_model("qwen2", tmp_path / "qwen2", seed=2, tokenizer=False))}
    results = run_ranks(f"{__name__}:export_rank", 4, {"dirs": dirs}, timeout=600)
    for name, hf_dir in dirs.items():
        ref = read_checkpoint(hf_dir)
        streams = [r[name]["everyone"] for r in results]
        assert all(s == streams[0] for s in streams), "ranks saw different streams"
        names = [n for b in streams[0] for n, _, _ in b]
        assert sorted(names) == sorted(ref) and len(names) == len(set(names))
        assert names[0] == "model.embed_tokens.weight" and names[-1] in ("lm_head.weight", "model.norm.weight")
        for bucket in streams[0]:
            assert sum(b for _, _, b in bucket) <= BUCKET or len({n.rsplit(".", 2)[0] for n, _, _ in bucket}) == 1
        assert len(streams[0]) > 3
        for r in results:
            buckets = r[name]["to_three"]
            assert len(buckets) == len(streams[0])
            if r[name]["rank"] == 3:
                got = {k: v for b in buckets for k, v in b.items()}
                assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
            else:
                assert all(b == {} for b in buckets)
        # each rank read only its own slices: a TP2 x PP2 rank reads about a quarter of the checkpoint
        total = sum(t.numel() * t.element_size() for t in ref.values())
        for r in results:
            assert r[name]["load"]["bytes_read"] < 0.45 * total, (r[name]["load"]["bytes_read"], total)


# ---- errors through the real import path -----------------------------------------------------------------------------
def import_error_rank(hf_dir: str, tp: int):
    from megarl.bridge import BridgeError
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    try:
        build_and_load(hf_dir)
    except BridgeError as exc:
        return str(exc)
    return None


def test_import_errors_name_the_tensor_or_field(tmp_path):
    from safetensors.torch import save_file

    src = make_tiny_model("qwen3", tmp_path / "src", tokenizer=False, max_shard_size=None)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = read_checkpoint(bad)
    tensors.pop("model.layers.2.self_attn.k_norm.weight")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:64].clone()
    save_file(tensors, str(bad / "model.safetensors"))
    msg = run_ranks(f"{__name__}:import_error_rank", 1, {"hf_dir": str(bad), "tp": 1}, timeout=300)[0]
    assert "model.layers.2.self_attn.k_norm.weight: missing from" in msg
    assert "model.layers.1.mlp.up_proj.weight has shape (64, 64) in the checkpoint but config.json implies (128, 64)" \
        in msg
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_key_value_heads"], cfg["num_attention_heads"] = 1, 2
    (bad / "config.json").write_text(json.dumps(cfg))
    msgs = run_ranks(f"{__name__}:import_error_rank", 2, {"hf_dir": str(bad), "tp": 2}, timeout=300)
    assert all("tensor_model_parallel_size=2 does not divide num_key_value_heads=1" in m for m in msgs), msgs
