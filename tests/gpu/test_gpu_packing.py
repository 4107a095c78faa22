"""Packed micro-batches through Transformer Engine's THD attention (run with `make test-gpu` on a CUDA GPU with TE;
skipped elsewhere): the rows of tests/dist/test_packing.py (very different lengths, one pack) give HF transformers'
logprobs within the derived float32 bound, with TE's spec (the boundaries on the device) as without it (megarl's
SDPA attention per row, the boundaries on the host)."""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_packing import tiny  # noqa: F401 - a fixture

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def float32_means_float32():
    from megarl.megatron.precision import apply_precision

    apply_precision(allow_tf32=False)
    yield


def te_rank(hf_dir: str, tokens, lengths):
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load, te_available
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=123)
    out = {}
    for use_te in ([True] if te_available() else []) + [False]:
        model, _ = build_and_load(hf_dir, dtype=torch.float32, use_te=use_te)
        model.eval()
        assert model.megarl_te is use_te
        out[use_te] = token_logprobs(model, tokens, micro_batch_size=len(tokens), lengths=lengths).cpu()
    return out


def test_packed_logprobs_with_and_without_te_equal_hf(tiny):  # noqa: F811
    models, tokens, lengths, mask, refs = tiny
    ref, tol = refs["qwen3"]
    (out,) = run_ranks(f"{__name__}:te_rank", 1, {"hf_dir": models["qwen3"], "tokens": tokens, "lengths": lengths},
                       timeout=600)
    assert True in out, "Transformer Engine is not importable on this GPU machine"
    for use_te, got in out.items():
        diff = ((got - ref).abs() * mask).max().item()
        print(f"[measured] packed, TE {use_te}: vs HF {diff:.2e} (bound {tol:.2e})")
        assert diff < tol, (use_te, diff, tol)
