"""A real pretrained model (SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, 9 query / 3 KV heads of 64, tied
embeddings, vocabulary 49152) through the commands a user runs on it: verify (TP3, PP2, against vLLM after a weight
sync, with a LoRA adapter merged and adapter-only), import + merge (bitwise), a 3-step GRPO run on the real recipe
(engine and trainer logprobs agree) and the merged result of that run scored in transformers (the same validation
accuracy as megarl reported). Slow tier: the model is built once per machine by `megarl get-model`
(tests/helpers/real_model.py) and each test runs the `megarl` command line in a fresh interpreter.

Sizes are cut for 2 CPU cores (verify on 2 sequences of up to 64 tokens; the run: 2 prompts x 2 samples of up to 32
tokens), never the checks."""
from __future__ import annotations

import contextlib
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.real_model import real_model_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_smollm2_cpu.yaml"
VERIFY = ["--batch", "2", "--seq-len", "64"]  # verify's batch: 2 sequences of 64 and 48 tokens
RESPONSE_LENGTH = 32
STEPS = 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return real_model_dir()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def megarl(*args, timeout: int = 900) -> str:
    """`python -m megarl.cli ARGS` from the repository root; its stdout after checking it succeeded."""
    start, cpu = time.perf_counter(), _cpu_s()
    r = subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                       timeout=timeout)
    print(f"[measured] megarl {args[0]}: {time.perf_counter() - start:.0f} s wall, {_cpu_s() - cpu:.0f} s CPU")
    assert r.returncode == 0, f"megarl {' '.join(map(str, args))}: exit {r.returncode}\n" + r.stdout[-3000:] + \
        r.stderr[-3000:]
    return r.stdout


def verdict(out: str, other: str = "megarl", reference: str = "HF") -> tuple:
    """(max abs logprob difference, derived tolerance) from verify's last line, which must say OK."""
    m = re.search(rf"max abs logprob difference (\S+) \({other} vs {re.escape(reference)}, tolerance (\S+), derived"
                  rf".*: (OK|FAILED)", out)
    assert m, out
    assert m.group(3) == "OK", out
    return float(m.group(1)), float(m.group(2))


def engine_verdict(out: str, reference: str = "HF") -> tuple:
    """verify --engine vllm: (vLLM vs megarl, megarl vs HF (or HF+PEFT), tolerance); both within the tolerance that
    verify derives from the reference's logits (it judges only the first; the second is judged here)."""
    vllm, tol = verdict(out, other="vLLM", reference="megarl")
    assert "checksums verified" in out, out
    hf = float(out.split("megarl vs HF transformers: ")[1].split()[0])
    assert hf < tol, (hf, tol, reference)
    return vllm, hf, tol


# ----------------------------------------------------------------------------------------------------------------------
# 1. verify: megarl's megatron model vs HF transformers at layouts the model's shapes make interesting


def test_verify_tp3(smollm2):
    """9 query / 3 KV heads: TP2 cannot split them, TP3 gives each rank 3 query heads and 1 KV head."""
    out = megarl("verify", "--hf", smollm2, "--tp", "3", *VERIFY)
    diff, tol = verdict(out)
    assert "TP=3 PP=1" in out and "batch from tokenizer" in out, out
    print(f"[measured] verify TP3: max |logprob diff| megarl vs HF {diff:.2e} (bound {tol:.2e}, margin {tol / diff:.0f}x)")


def test_verify_pp2(smollm2):
    """Tied embeddings split across two pipeline stages: the first holds the embedding, the last the LM head, which
    must be the same tensor (megatron shares it through the embedding group)."""
    out = megarl("verify", "--hf", smollm2, "--pp", "2", *VERIFY)
    diff, tol = verdict(out)
    assert "TP=1 PP=2" in out, out
    print(f"[measured] verify PP2: max |logprob diff| megarl vs HF {diff:.2e} (bound {tol:.2e}, margin {tol / diff:.0f}x)")


@pytest.mark.vllm
def test_verify_engine_vllm(smollm2):
    """megarl's weights pushed into a vLLM engine started with random weights (the trainer's sync): vLLM's logprobs
    equal megarl's, and megarl's equal HF's, within the derived bound."""
    out = megarl("verify", "--hf", smollm2, "--engine", "vllm", *VERIFY)
    vllm, hf, tol = engine_verdict(out)
    assert "272 tensors" in out, out  # every tensor of the model (the tied head is the embedding) went through the sync
    print(f"[measured] verify engine vLLM: vLLM vs megarl {vllm:.2e}, megarl vs HF {hf:.2e} (bound {tol:.2e})")


# ----------------------------------------------------------------------------------------------------------------------
# 2. import at TP3, merge back: bitwise the original


def _tensors(model_dir: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                assert key not in out, f"{key} in two shards of {model_dir}"
                out[key] = f.get_tensor(key)
    return out


def test_import_tp3_then_merge_is_bitwise_the_original(smollm2, tmp_path):
    megarl("import", "--hf", smollm2, "--out", tmp_path / "imported", "--tp", "3")
    meta = json.loads((tmp_path / "imported" / "checkpoints" / "step_0" / "meta.json").read_text())
    assert meta["parallelism"]["tensor_model_parallel_size"] == 3, meta
    out = tmp_path / "merged"
    megarl("merge", "--ckpt", tmp_path / "imported", "--out", out, "--no-progress")
    source, merged = _tensors(smollm2), _tensors(out)
    # 30 layers x 9 tensors + the embedding + the final norm; tied: no lm_head.weight in the original, none written
    assert len(source) == 30 * 9 + 2 == 272 and "lm_head.weight" not in source
    assert sorted(merged) == sorted(source)
    for key, t in source.items():
        m = merged[key]
        assert m.dtype == t.dtype and m.shape == t.shape, (key, m.dtype, t.dtype, m.shape, t.shape)
        assert torch.equal(m.contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)), key
    config, original = (json.loads((d / "config.json").read_text()) for d in (out, smollm2))
    for key in ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert config.get(key) == original.get(key), (key, config.get(key), original.get(key))
    assert config.get("rope_parameters", config.get("rope_theta")) == original.get("rope_parameters",
                                                                                  original.get("rope_theta"))
    # the tokenizer, its chat template and the generation config come along unchanged
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2 / name).exists():
            assert (out / name).read_bytes() == (smollm2 / name).read_bytes(), name
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    a, b = (AutoTokenizer.from_pretrained(str(d)).apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False) for d in (smollm2, out))
    assert a == b and a.endswith("<|im_start|>assistant\n"), (a, b)
    print(f"[measured] import TP3 + merge: {len(merged)} tensors bitwise equal to the original")
    shutil.rmtree(tmp_path, ignore_errors=True)  # 1.1 GB (the checkpoint and the merged copy): not kept on success


# ----------------------------------------------------------------------------------------------------------------------
# 3. + 5. a short GRPO run on the real recipe, and its merged result scored in transformers


@pytest.fixture(scope="module")
def grpo_run(smollm2, tmp_path_factory):
    """recipes/grpo_smollm2_cpu.yaml cut small: 3 steps of 2 prompts x 2 samples of up to 32 tokens, a greedy
    validation at step 3 on 8 + 8 word problems (every generation written to val_generations.jsonl) and a checkpoint
    at step 3. The overlong buffer is shortened to fit the 32-token responses."""
    tmp = tmp_path_factory.mktemp("grpo_smollm2")
    data = tmp / "wp"
    subprocess.run([sys.executable, "tools/data/word_problems.py", "--out-dir", str(data), "--num-train", "64",
                    "--num-val", "8", "--steps", "1"], check=True, cwd=ROOT, capture_output=True, timeout=300)
    run_dir = tmp / "run"
    overrides = [f"model.path={smollm2}", f"trainer.run_dir={run_dir}", f"data.train_files=[{data / 'train.parquet'}]",
                 f"data.val_files=[{data / 'val.parquet'},{data / 'val_unseen.parquet'}]",
                 "data.train_batch_size=2", "rollout.n=2", f"rollout.response_length={RESPONSE_LENGTH}",
                 "actor.ppo_mini_batch_size=2", "reward.overlong_buffer.len=8",
                 f"trainer.total_steps={STEPS}", f"trainer.test_freq={STEPS}", "trainer.val_before_train=false",
                 "trainer.log_val_generations=16", f"checkpoint.save_freq={STEPS}", "logging.tensorboard=false"]
    start, cpu = time.perf_counter(), _cpu_s()
    r = subprocess.run([sys.executable, "-m", "megarl", "train", str(RECIPE), *overrides], capture_output=True,
                       text=True, cwd=ROOT, timeout=1800)
    print(f"[measured] megarl train ({STEPS} steps + val + checkpoint): {time.perf_counter() - start:.0f} s wall, "
          f"{_cpu_s() - cpu:.0f} s CPU")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    yield run_dir, data, metrics
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1.6 GB with the optimizer states


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the run is this test's setup: 8 minutes on 2 cores shared with other work
def test_grpo_engine_and_trainer_logprobs_agree(grpo_run):
    """After every weight sync the engine samples from the actor's distribution: the mean |vLLM - megatron| logprob
    of the sampled tokens stays far below 1e-3 (a stale or mis-mapped tensor moves it to ~0.1-1)."""
    _, _, metrics = grpo_run
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    diffs = [m["rollout/logprob_abs_diff_mean"] for m in metrics]
    print(f"[measured] rollout/logprob_abs_diff_mean per step {['%.2e' % d for d in diffs]}, max {max(diffs):.2e}")
    assert all(d < 1e-3 for d in diffs), diffs
    assert any(m["actor/grad_norm"] > 0 for m in metrics)  # the actor did move: steps 2 and 3 sample from updated weights


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to n inside: token-by-token decoding runs many tiny ops, and on a 2-core machine
    shared with other work, 2 spinning OpenMP threads made a 32-token generation take 160 s instead of 5 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _val_prompts(data: Path) -> list[dict]:
    import pandas as pd

    rows = []
    for name in ("val", "val_unseen"):  # data.val_files' order: megarl's validation set is their concatenation
        rows += pd.read_parquet(data / f"{name}.parquet").to_dict("records")
    return rows


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the run is the setup of whichever of the two tests runs first
def test_merged_run_scores_the_same_val_accuracy_in_transformers(grpo_run, tmp_path):
    """The run's last checkpoint merged to HF and decoded greedily by transformers (the chat template with its
    generation prompt, rollout.response_length new tokens, the model's eos) scores the val/acc_mean megarl reported.

    How close the two must be: vLLM and transformers both compute float32 logits of the same weights, which differ
    by rounding only: at most `tol` per logprob (the derived float32 bound, tests/helpers/bounds.logits_bound, of the
    merged model on these sequences). Along a common prefix, greedy decoding can pick differently only where the
    gap between the two candidates' logits is within 2 * tol (the log-normaliser cancels in the gap, each side's
    logprob moves by at most tol). So every sample whose response differs must first diverge at such a near tie
    (checked on transformers' logits at the first differing token, computed on the common prefix); only those k
    samples can score differently, so |acc(transformers) - acc(megarl)| <= k / N. A wrong merge (or a different
    prompt, eos or length) diverges at a wide gap and fails (a response edited at one token fails by a gap of 1.8,
    140x the 2 * tol of 1.3e-2). k is counted, not assumed; with no divergence the accuracies are equal.
    transformers decodes the 16 prompts as one left-padded batch (masked): another correct float32 forward.
    The megarl responses are re-tokenized from val_generations.jsonl's text; a non-canonical tokenization by the
    engine would show as a divergence at a wide gap (a false failure, not a false pass)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.reward.rules import gsm8k
    from tests.helpers.bounds import logits_bound

    run_dir, data, metrics = grpo_run
    assert (run_dir / "checkpoints" / f"step_{STEPS}").is_dir(), list((run_dir / "checkpoints").iterdir())
    last = metrics[-1]
    assert last["step"] == STEPS and "val/acc_mean" in last, sorted(last)
    out = tmp_path / "merged"
    megarl("merge", "--ckpt", run_dir, "--out", out, "--no-progress")
    megarl_rows = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    megarl_rows = [r for r in megarl_rows if r["step"] == STEPS]
    prompts = _val_prompts(data)
    assert len(megarl_rows) == len(prompts) == 16, (len(megarl_rows), len(prompts))
    assert abs(sum(r["acc"] for r in megarl_rows) / len(prompts) - last["val/acc_mean"]) < 1e-6  # the same samples

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()
    eos = model.generation_config.eos_token_id
    assert eos == tok.eos_token_id == json.loads((out / "config.json").read_text())["eos_token_id"], eos  # vLLM's eos
    encoded = []
    for i, (row, mine) in enumerate(zip(prompts, megarl_rows)):
        assert mine["label"] == f"prompt {i}", mine["label"]
        ids = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert tok.decode(ids, skip_special_tokens=True) == mine["prompt"], (i, mine["prompt"])  # the same prompt
        encoded.append(ids)
    width = max(map(len, encoded))  # one batch, left-padded (masked: each row's positions start at its first token)
    input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in encoded])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    start = time.perf_counter()
    with torch.no_grad(), _torch_threads(1):
        gen = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=RESPONSE_LENGTH,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos, output_logits=True,
                             return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    accs, diverged, scores, longest = [], [], [], 0
    for i, (row, mine) in enumerate(zip(prompts, megarl_rows)):
        response = gen.sequences[i, width:].tolist()
        if eos in response:  # up to and including the first eos (the rest is padding)
            response = response[: response.index(eos) + 1]
        logits = torch.stack([step[i] for step in gen.logits[: len(response)]]).float()  # [T, V] per generated token
        scores.append(logits)
        longest = max(longest, len(encoded[i]) + len(response))
        text = tok.decode(response, skip_special_tokens=True)
        acc = float(gsm8k(row["data_source"], text, row["ground_truth"]))
        accs.append(acc)
        if text != mine["response"]:
            theirs = tok(mine["response"], add_special_tokens=False)["input_ids"]
            j = next((k for k in range(min(len(theirs), len(response))) if theirs[k] != response[k]),
                     min(len(theirs), len(response)))
            # past the shorter one: megarl's response ended (eos) where transformers went on
            other = theirs[j] if j < len(theirs) else eos
            gap = float(logits[j].max() - logits[j, other]) if j < len(logits) else float("inf")
            diverged.append((i, j, gap, acc, mine["acc"]))
    tol = logits_bound(out, torch.cat(scores)[None], seq_len=longest)
    acc_hf, acc_megarl = sum(accs) / len(accs), last["val/acc_mean"]
    print(f"[measured] val accuracy: megarl {acc_megarl:.4f}, transformers {acc_hf:.4f} on {len(accs)} prompts; "
          f"{len(diverged)} responses differ {[(i, j, f'{g:.1e}') for i, j, g, _, _ in diverged]} (near tie: gap < "
          f"{2 * tol:.1e}); decoding {seconds:.0f} s")
    wide = [d for d in diverged if not d[2] < 2 * tol]
    assert not wide, f"responses diverging where the two engines cannot disagree (gap >= {2 * tol:.1e}): {wide}"
    assert abs(acc_hf - acc_megarl) <= len(diverged) / len(accs) + 1e-9, (acc_hf, acc_megarl, diverged)
    shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------------
# 4. LoRA on the real model


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory):
    """A PEFT LoRA adapter (rank 8 on every linear layer, random non-zero A and B) saved by PEFT itself; it moves HF's
    logprobs on verify's batch far beyond the bound, so a sync that dropped it would fail."""
    from megarl import hf_reference
    from megarl.verify import make_batch
    from tests.helpers.tiny_models import make_peft_adapter

    path = make_peft_adapter(smollm2, tmp_path_factory.mktemp("lora") / "adapter", rank=8, alpha=16.0, scale=0.02)
    tokens, lengths, source = make_batch(str(smollm2), 49152, 2, 64)
    assert source == "tokenizer"
    base = hf_reference.hf_logprobs(str(smollm2), tokens)
    with_adapter = hf_reference.hf_logprobs(str(smollm2), tokens, lora=str(path))
    mask = hf_reference.real_mask(lengths, base.shape[1])
    moved = (base - with_adapter).abs()[mask].max().item()
    return path, moved


@pytest.mark.vllm
@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_verify_lora_engine_vllm(smollm2, adapter, sync):
    """merged: base + alpha/r * B A pushed into vLLM; adapter: vLLM started with its LoRA support receives only the
    adapters. Both: vLLM's logprobs equal megarl's, megarl's equal HF + PEFT's."""
    path, moved = adapter
    out = megarl("verify", "--hf", smollm2, "--lora", path, "--engine", "vllm", "--lora-sync", sync, *VERIFY)
    vllm, hf, tol = engine_verdict(out, reference="HF+PEFT")
    assert moved > 10 * tol, (moved, tol)  # the adapter matters: a sync that dropped it would miss the bound by far
    if sync == "adapter":
        assert "adapter sync into vLLM's LoRA support" in out, out
    print(f"[measured] verify LoRA {sync} sync: vLLM vs megarl {vllm:.2e}, megarl vs HF+PEFT {hf:.2e} (bound "
          f"{tol:.2e}); the adapter moves HF's logprobs by {moved:.2f}")
