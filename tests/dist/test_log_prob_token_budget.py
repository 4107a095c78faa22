"""rollout.log_prob_use_dynamic_bsz: forward-only passes in token-budget micro-batches give the same logprobs and
values as fixed micro-batches (and HF transformers' logprobs) on every real position, the rows back in their order."""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import logprob_bound, score_bound
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
ROWS, SEQ, BUDGET = 7, 24, 40  # rows of 8..24 tokens: groups of 1 to 4 rows, some cut well short of SEQ


def forwards_rank(hf_dir: str, tokens, lengths):
    from megarl.batching import forward_by_token_budget, token_budget_groups
    from megarl.megatron.forward import token_logprobs, token_values
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=1)
    model, _ = build_and_load(hf_dir, dtype=torch.float32)
    critic, _ = build_and_load(hf_dir, dtype=torch.float32, value_head=True)
    model.eval(), critic.eval()
    width = tokens.shape[1] - 1
    fixed = token_logprobs(model, tokens, micro_batch_size=2)
    budget = forward_by_token_budget(lambda x, mb, lens: token_logprobs(model, x, mb, lengths=lens), tokens, lengths,
                                     BUDGET, width)
    values_fixed = token_values(critic, tokens, micro_batch_size=2)[:, :width]
    values_budget = forward_by_token_budget(
        lambda x, mb, lens: token_values(critic, x, mb, lengths=lens)[:, :x.shape[1] - 1], tokens, lengths, BUDGET,
        width)
    groups = token_budget_groups(lengths.tolist(), BUDGET)
    return fixed, budget, values_fixed, values_budget, groups


def test_token_budget_matches_fixed_micro_batches_and_hf(tmp_path):
    hf_dir = str(make_tiny_model("qwen2", tmp_path / "qwen2", seed=0))
    tokens, lengths = sample_tokens(ROWS, SEQ, seed=3)
    (fixed, budget, v_fixed, v_budget, groups), = run_ranks(
        f"{__name__}:forwards_rank", 1, {"hf_dir": hf_dir, "tokens": tokens, "lengths": lengths}, timeout=300)
    assert len(groups) > 1 and any(len(g) > 1 for g in groups)  # really packed, really several micro-batches
    assert all(sum(int(lengths[r]) for r in g) <= BUDGET or len(g) == 1 for g in groups)
    mask = torch.arange(SEQ - 1)[None, :] < (lengths[:, None] - 1)  # positions whose next token is real
    assert budget.shape == fixed.shape == (ROWS, SEQ - 1)
    # other micro-batch shapes (rows packed, columns cut) are other GEMM shapes: rounding only, as against HF
    tol = logprob_bound(hf_dir, tokens, mask)
    v_tol = score_bound(hf_dir, v_fixed[mask], SEQ)  # the critic's values: a linear read-out of the last state
    diffs = (((budget - fixed).abs() * mask).max().item(),
             ((budget - hf_logprobs(hf_dir, tokens)).abs() * mask).max().item(),
             ((v_budget - v_fixed).abs() * mask).max().item())
    print(f"[measured] budget vs fixed {diffs[0]:.2e}, vs HF {diffs[1]:.2e} (bound {tol:.2e}); values {diffs[2]:.2e} "
          f"(bound {v_tol:.2e})")
    assert diffs[0] < tol and diffs[1] < tol and diffs[2] < v_tol, (diffs, tol, v_tol)
