"""The transformers engine (rollout.name=hf, megarl.rollout.hf.engine), as tests/e2e/test_vllm_engine.py,
test_engine_requests.py and test_engine_control.py check the vLLM engine:

* n samples per prompt in groups, their logprobs equal HF's forward of the same tokens within the derived float32 bound
  (one batched decode with a KV cache vs one full forward: rounding only); the sampler reports vLLM's processed
  logprobs (temperature, top-k, top-p) and raw ones on request;
* greedy is deterministic, validation takes val_kwargs; a seed reproduces a batch whatever ran before; length, EOS,
  ignore_eos and stop tokens end rows as vLLM's do; prompt overflow policies;
* abort from another thread mid-generate returns prefixes of the un-aborted samples, and the engine keeps serving;
  agenerate calls in flight together equal generate with the same seeds; abort through the engine process;
* a whole-tensor update verified by checksums; sleep releases the weights' memory (parameter storage bytes to 0, or
  the arena's resident pages), wake and a sync restore the same logprobs; level 1 keeps them on the host.
"""
import asyncio
import threading
import time

import pytest
import torch

from megarl.config.schema import RolloutConfig
from tests.helpers.bounds import rollout_bound
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 42, 9, 88], [100, 101, 102], [7, 8, 9, 10, 11, 12]]


def config(**kw) -> RolloutConfig:
    args = dict(name="hf", prompt_length=16, response_length=12, ignore_eos=True, temperature=1.0, n=2,
                max_num_seqs=16)
    args.update(kw)
    return RolloutConfig(**args)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("hf_engine") / "qwen2"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    from megarl.rollout.hf.engine import HFEngine

    eng = HFEngine(config(), model_dir, seed=0, device="cpu")
    yield eng
    eng.shutdown()


def reference_logprobs(hf_model, batch, temperature=1.0):
    """HF's logprob of every sampled token at `temperature`, one full forward per row: [N, R] (0 past the end)."""
    out = torch.zeros_like(batch.rollout_logprobs)
    for i in range(len(batch)):
        prompt, resp = list(batch.prompt_ids[i]), list(batch.response(i))
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + resp])).logits[0].float() / temperature
        lp = logits[len(prompt) - 1: -1].log_softmax(-1)
        out[i, :len(resp)] = lp.gather(1, torch.tensor(resp)[:, None]).squeeze(1)
    return out


def test_protocol():
    from megarl.rollout.hf.engine import HFEngine
    from megarl.rollout.protocol import RolloutEngine
    from megarl.sync.seam import missing_members

    assert missing_members(HFEngine, RolloutEngine) == []


def test_n_samples_groups_and_logprobs_match_hf(engine, hf_model):
    batch = engine.generate(PROMPTS, seed=1)
    assert len(batch) == 6 and batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.finish_reasons == ["length"] * 6 and batch.response_lengths.tolist() == [12] * 6
    diff = (batch.rollout_logprobs - reference_logprobs(hf_model, batch)).abs().max().item()
    tol = rollout_bound(batch, hf_model)
    print(f"[measured] hf engine sampled logprobs vs HF forward {diff:.2e} (bound {tol:.2e})")
    assert diff < tol
    assert batch.metrics["rollout/num_samples"] == 6.0 and batch.weight_version == engine.weight_version


def test_processed_and_raw_logprobs_with_temperature_and_top_k(model_dir, hf_model):
    from megarl.rollout.hf.engine import HFEngine

    for mode, temp_of_ref in (("processed_logprobs", 0.7), ("raw_logprobs", 1.0)):
        eng = HFEngine(config(temperature=0.7, logprobs_mode=mode), model_dir, seed=0, device="cpu")
        batch = eng.generate(PROMPTS, seed=4)
        ref = reference_logprobs(hf_model, batch, temp_of_ref)
        assert (batch.rollout_logprobs - ref).abs().max().item() < rollout_bound(batch, hf_model) / temp_of_ref, mode
    # top-k 2: every sampled token is one of the two most likely, and its processed logprob is over those two
    eng = HFEngine(config(top_k=2), model_dir, seed=0, device="cpu")
    batch = eng.generate(PROMPTS, seed=4)
    for i in range(len(batch)):
        prompt, resp = list(batch.prompt_ids[i]), list(batch.response(i))
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1: -1]
        top2 = logits.topk(2, dim=-1)
        assert all(t in top2.indices[j].tolist() for j, t in enumerate(resp))
        ref = [top2.values[j].log_softmax(-1)[top2.indices[j].tolist().index(t)].item() for j, t in enumerate(resp)]
        assert batch.logprobs(i) == pytest.approx(ref, abs=1e-4)


def test_greedy_is_deterministic_and_validation_uses_val_kwargs(engine, hf_model):
    a = engine.generate(PROMPTS, validate=True)  # val_kwargs: greedy, n=1
    b = engine.generate(PROMPTS, validate=True)
    assert len(a) == 3 and torch.equal(a.response_ids, b.response_ids)
    for i, p in enumerate(PROMPTS):  # HF's own greedy decoding
        ref = hf_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(p):]
        assert list(a.response(i)) == ref.tolist()


def test_seed_reproducibility(engine):
    a = engine.generate(PROMPTS, seed=9)
    engine.generate(PROMPTS[:1], n=5)  # other work in between (the engine's own generator moves)
    b = engine.generate(PROMPTS, seed=9)
    c = engine.generate(PROMPTS, seed=10)
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)
    # a prompt's samples do not depend on its batch: prompt 1 alone, as index 1, gives the same rows
    alone = engine.generate(PROMPTS[1:2], seed=9, prompt_index=[1])
    assert torch.equal(alone.response_ids, a.response_ids[2:4])


def test_max_length_ignore_eos_and_stop_tokens(model_dir, engine):
    from megarl.rollout.hf.engine import HFEngine

    free = engine.generate(PROMPTS, seed=3)
    first = int(free.response(0)[2])  # the third token of row 0 becomes a stop token
    eng = HFEngine(config(stop_token_ids=[first]), model_dir, seed=0, device="cpu")
    stopped = eng.generate(PROMPTS, seed=3)
    row = list(stopped.response(0))
    assert stopped.finish_reasons[0] == "stop" and row == list(free.response(0))[:len(row)] and row[-1] == first
    eos = HFEngine(config(ignore_eos=False), model_dir, seed=0, device="cpu")
    eos.eos_ids = [first]  # the model's EOS, as vLLM reads it from generation_config
    out = eos.generate(PROMPTS, seed=3)
    assert out.finish_reasons[0] == "stop" and list(out.response(0))[-1] == first
    assert all(r in ("stop", "length") for r in out.finish_reasons)


def test_prompt_overflow_policies(model_dir):
    from megarl.rollout.vllm.engine import PromptTooLongError
    from megarl.rollout.hf.engine import HFEngine

    long = list(range(3, 23))  # 20 tokens > prompt_length 16
    with pytest.raises(PromptTooLongError):
        HFEngine(config(), model_dir, device="cpu").generate([long])
    left = HFEngine(config(), model_dir, device="cpu", prompt_overflow="left").generate([long, [5, 6]], n=1)
    assert left.prompt_ids[0] == long[-16:] and left.metrics["rollout/prompts_truncated"] == 1.0
    kept = HFEngine(config(), model_dir, device="cpu", prompt_overflow="filter").generate([long, [5, 6]], n=1)
    assert len(kept) == 1 and kept.prompt_index.tolist() == [1]


def generate_aborted_at_step(engine, at_step, *args, **kwargs):
    """engine.generate aborted from another thread while its `at_step`-th forward runs."""
    model = engine.model
    forward, calls, reached = model.forward, [0], threading.Event()

    def counting(*a, **k):
        calls[0] += 1
        if calls[0] == at_step:
            reached.set()
            time.sleep(0.2)  # the abort lands while this step runs
        return forward(*a, **k)

    model.forward = counting
    aborter = threading.Thread(target=lambda: (reached.wait(60), engine.abort()))
    aborter.start()
    try:
        return engine.generate(*args, **kwargs)
    finally:
        aborter.join()
        del model.forward


def test_abort_from_another_thread_returns_partial_samples_and_keeps_serving(model_dir, hf_model):
    from megarl.rollout.hf.engine import HFEngine

    eng = HFEngine(config(response_length=40), model_dir, seed=0, device="cpu")
    full = eng.generate(PROMPTS, seed=11)
    partial = generate_aborted_at_step(eng, 10, PROMPTS, seed=11)
    assert partial.finish_reasons == ["abort"] * 6 and partial.metrics["rollout/num_aborted"] == 6
    tol = rollout_bound(full, hf_model)
    for i in range(6):
        got = list(partial.response(i))
        assert 0 < len(got) <= 10 and got == list(full.response(i))[:len(got)]  # prefill + 9 steps, then the abort
        assert partial.logprobs(i) == pytest.approx(full.logprobs(i)[:len(got)], abs=tol)
    again = eng.generate(PROMPTS, seed=11)
    assert again.finish_reasons == ["length"] * 6 and torch.equal(again.response_ids, full.response_ids)


def test_agenerate_in_flight_together_equal_generate(engine):
    ref = engine.generate(PROMPTS, seed=3, n=2)
    sampling = engine.sampling_kwargs(max_tokens=12)

    async def one(i):
        if i == 1:  # waits on a "tool" first: the others generate meanwhile
            await asyncio.sleep(0.05)
        return await engine.agenerate(PROMPTS[i], sampling, n=2, seed=3 + i * 2)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    for i, comps in enumerate(asyncio.run(main())):
        for j, c in enumerate(comps):
            assert c.finish_reason == "length" and c.token_ids == list(ref.response(2 * i + j))
            assert c.logprobs == pytest.approx(ref.logprobs(2 * i + j), abs=1e-4)
            assert c.token_versions == [engine.weight_version] * 12


@pytest.mark.slow  # an engine process and three generations of 120 tokens; in process: the abort test above
def test_abort_through_the_engine_process(model_dir):
    from megarl.rollout.hosting.process import EngineProcess

    engine = EngineProcess(config(response_length=120, max_num_seqs=16), model_dir, seed=0, name="megarl-hf-engine")
    try:
        t0 = time.perf_counter()
        full = engine.generate(PROMPTS, seed=2, n=2)
        full_s = time.perf_counter() - t0
        box = {}
        runner = threading.Thread(target=lambda: box.update(batch=engine.generate(PROMPTS, seed=2, n=2)))
        runner.start()
        time.sleep(full_s / 4)
        engine.abort()
        runner.join(120)
        partial = box["batch"]
        assert "abort" in partial.finish_reasons
        for i in range(len(partial)):
            assert list(partial.response(i)) == list(full.response(i))[:len(partial.response(i))]
        assert engine.generate(PROMPTS, seed=2, n=2).finish_reasons == ["length"] * 6
    finally:
        engine.shutdown()


def test_update_verified_sleep_frees_weights_and_wake_restores(model_dir, hf_model):
    from megarl.rollout.hf.engine import HFEngine

    eng = HFEngine(config(load_format="dummy", enable_sleep_mode=True), model_dir, seed=0, device="cpu")
    state = {k: v for k, v in hf_model.state_dict().items()}
    metrics = eng.update_weights([list(state.items())[:20], list(state.items())[20:]], verify=True)
    assert metrics["weight_sync/verified_tensors"] > 0 and eng.weight_version == 1
    full_bytes = eng.parameter_bytes()
    ref = eng.generate(PROMPTS, seed=5)
    eng.sleep()  # level 2: the weights are dropped, the next sync refills them
    asleep = eng.parameter_bytes()
    print(f"[measured] hf engine parameter storage: awake {full_bytes} B, asleep {asleep} B")
    assert full_bytes >= sum(p.numel() * 4 for p in hf_model.parameters() if p is not hf_model.lm_head.weight) \
        and asleep == 0
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(PROMPTS)
    eng.wake_up(["weights"])
    assert eng.parameter_bytes() == full_bytes
    eng.update_weights([list(state.items())], verify=True)
    eng.wake_up(["kv_cache"])
    assert torch.equal(eng.generate(PROMPTS, seed=5).response_ids, ref.response_ids)
    eng.sleep(level=1)  # kept on the host: wake restores the same weights without a sync
    assert eng.parameter_bytes() == 0
    eng.wake_up()
    assert torch.equal(eng.generate(PROMPTS, seed=5).response_ids, ref.response_ids)
    assert eng.events == ["update", "sleep", "wake_up(weights)", "update", "wake_up(kv_cache)", "sleep(1)",
                          "wake_up"]


def test_placed_weights_sleep_releases_the_arena(model_dir, hf_model, tmp_path):
    """With the sync's placed writes (the parameters in a shared-memory arena its host writes into), sleep level 2
    gives the arena's pages back while both mappings stay valid; the next placed writes bring the same weights back."""
    from megarl.bridge.hf_config import load_spec
    from megarl.bridge.mapping import Mapping
    from megarl.rollout.hf.engine import HFEngine
    from megarl.sync.shards import worker_needs
    from megarl.sync.placement import region_viewer, write_placed
    from megarl.sync.boxes import full_box
    from megarl.sync.wire import shm_dir

    eng = HFEngine(config(load_format="dummy", enable_sleep_mode=True), model_dir, seed=0, device="cpu")
    mapping = Mapping(load_spec(model_dir))
    shapes = mapping.hf_shapes()
    needs = {h: ("float32", list(shapes[h]), [list(b) for b in box])
             for h, box in worker_needs(mapping, eng.layouts[0]).items()}
    report = eng.place_weights([needs], f"{shm_dir()}/megarl-test-{tmp_path.name}")[0]
    assert not report["refused"] and set(report["placed"]) == set(needs)
    arena = torch.from_file(report["arena"], shared=True, size=report["size"], dtype=torch.uint8)  # the host's view
    import os

    os.unlink(report["arena"])
    views, state = region_viewer([arena]), hf_model.state_dict()

    def write_all():  # as the hosting trainer rank does at every sync
        eng.begin_update()
        for name, recs in report["placed"].items():
            write_placed(views, [(tuple(tuple(b) for b in r[0]),) + tuple(r[1:]) for r in recs],
                         full_box(state[name].shape), state[name])
        eng.end_update()

    write_all()
    ref = eng.generate(PROMPTS, seed=5)
    awake = eng.parameter_bytes()
    eng.sleep()
    asleep = eng.parameter_bytes()
    print(f"[measured] hf engine arena resident: awake {awake} B, asleep {asleep} B")
    assert awake >= sum(t.numel() * 4 for t in state.values()) // 2 and asleep < awake // 100
    eng.wake_up(["weights"])
    write_all()
    eng.wake_up(["kv_cache"])
    assert torch.equal(eng.generate(PROMPTS, seed=5).response_ids, ref.response_ids)
    eng.shutdown()
