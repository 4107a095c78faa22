"""A forward over a row count the micro-batch size does not divide (7 rows, micro-batches of 4: the last one padded)
gives HF transformers' logprobs for every row, so workers need not shrink the micro-batch to a divisor of the rows."""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import logprob_bound
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
ROWS, SEQ, MICRO = 7, 16, 4


def logprobs_rank(hf_dir: str, tokens, micro: int):
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=1)
    model, _ = build_and_load(hf_dir, dtype=torch.float32)
    model.eval()
    return token_logprobs(model, tokens, micro_batch_size=micro)


def test_padded_last_micro_batch_matches_hf(tmp_path):
    hf_dir = str(make_tiny_model("llama", tmp_path / "llama", seed=0))
    tokens, lengths = sample_tokens(ROWS, SEQ, seed=5)
    ref = hf_logprobs(hf_dir, tokens)
    (got,) = run_ranks(f"{__name__}:logprobs_rank", 1, {"hf_dir": hf_dir, "tokens": tokens, "micro": MICRO},
                       timeout=300)
    mask = torch.arange(SEQ - 1)[None, :] < (lengths[:, None] - 1)
    assert got.shape == (ROWS, SEQ - 1)
    diff, tol = ((got - ref).abs() * mask).max().item(), logprob_bound(hf_dir, tokens, mask)
    print(f"[measured] padded micro-batch vs HF {diff:.2e} (bound {tol:.2e})")
    assert diff < tol, (diff, tol)
