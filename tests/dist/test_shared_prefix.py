"""Shared prefixes (megarl.megatron.shared_prefix) on real megatron-core: groups of rows with one prompt compute it
once, and nothing a row reads changes.

- Logprobs of GRPO-shaped rows (two prompts with 3 and 2 samples, a row alone, a sample that is another's prefix)
  with prefixes shared equal HF transformers' on the padded rows within the derived float32 bound
  (tests/helpers/bounds.py), and the shared pack computes fewer tokens than the rows hold.
- One PPO update on those rows with prefixes shared equals the update with every row packed whole: loss, grad norm
  and every parameter within the bounds of tests.helpers.bounds.assert_same_ppo_step.
Both in one launch (TP1, about a minute on 2 cores); TP2 with sequence parallelism (the pack padded to a multiple of
TP) and PP2 (every stage lays out the same pack) in the slow tier.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import ADAM_EPS, assert_same_ppo_step, logprob_bound
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model

pytestmark = pytest.mark.parity
LR = 1e-3


def _rows(seed: int = 11):
    """tokens [6, S] right-padded, lengths [6], response mask [6, S-1]: prompt A (12 tokens) with 3 samples, prompt B
    (6 tokens) with 2, one row alone; A's third sample is its first one cut short."""
    g = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randint(1, 120, (n,), generator=g).tolist()

    a, b = draw(12), draw(6)
    first = draw(9)
    rows = [(a, first), (b, draw(7)), (a, draw(5)), (draw(4), draw(8)), (a, first[:3]), (b, draw(11))]
    s = max(len(p) + len(r) for p, r in rows)
    tokens = torch.zeros(len(rows), s, dtype=torch.long)
    mask = torch.zeros(len(rows), s - 1, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        tokens[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1:len(p) + len(r) - 1] = True  # column c scores token c + 1: the response's tokens
    return tokens, torch.tensor([len(p) + len(r) for p, r in rows]), mask


def shared_rank(hf_dir: str, batch: dict, lengths, tp: int = 1, pp: int = 1):
    from megarl.config.schema import OptimConfig
    from megarl.megatron import shared_prefix, train_step
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.packing import pack_size

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    out = {"sizes": (pack_size(lengths), pack_size(lengths, tokens=batch["input_ids"])), "shared_calls": 0}
    attend = shared_prefix.attend

    def counted(*args, **kwargs):  # the attention of a shared pack ran
        out["shared_calls"] += 1
        return attend(*args, **kwargs)

    shared_prefix.attend = counted
    for share in (True, False):
        model, spec = build_and_load(hf_dir, dtype=torch.float32, sequence_parallel=tp > 1 or None)
        assert shared_prefix.enable(model, share) == share
        model.eval()
        with torch.no_grad():
            out[f"logprobs_{share}"] = token_logprobs(model, batch["input_ids"], micro_batch_size=6, lengths=lengths)
        model.train()
        trainable = train_step.make_trainable(
            model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0, clip_grad=0.0), total_steps=10)
        settings = PolicyLossSettings(vocab_size=spec.vocab_size)
        denominator = train_step.loss_denominator([batch["response_mask"]], settings.loss_agg_mode)
        metrics = train_step.train_mini_batch(trainable, [dict(batch)], PolicyLoss(settings, denominator))
        out[f"step_{share}"] = {"metrics": metrics, "params": {
            n: p.detach().clone() for n, p in trainable.chunks[0].module.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    hf_dir = str(make_tiny_model("qwen3", tmp_path_factory.mktemp("shared") / "qwen3", seed=4))
    tokens, lengths, mask = _rows()
    g = torch.Generator().manual_seed(5)
    # on-policy old logprobs (HF's): every ratio is 1 up to rounding, far from the clip edges
    batch = {"input_ids": tokens, "response_mask": mask, "old_log_probs": hf_logprobs(hf_dir, tokens),
             "advantages": torch.randn(*mask.shape, generator=g)}
    [result] = run_ranks(f"{__name__}:shared_rank", 1, {"hf_dir": hf_dir, "batch": batch, "lengths": lengths},
                         timeout=420)
    return hf_dir, batch, lengths, result


def test_shared_prefix_logprobs_equal_hf_and_compute_fewer_tokens(run):
    hf_dir, batch, lengths, result = run
    whole, shared = result["sizes"]
    # prompt A's 3 rows share 11 tokens (12 - the repeated last one), B's 2 rows share 5: 2 * 11 + 5 saved
    assert whole == int(lengths.sum()) and shared == whole - (2 * 11 + 5), result["sizes"]
    # the shared attention ran in every layer (4) of the logprob pass and of the update's forward
    assert result["shared_calls"] == 4 * 2, result["shared_calls"]
    tokens = batch["input_ids"]
    valid = torch.arange(tokens.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
    ref, tol = hf_logprobs(hf_dir, tokens), logprob_bound(hf_dir, tokens, valid)
    for share in (True, False):
        got = result[f"logprobs_{share}"]
        diff = ((got - ref).abs() * valid).max().item()
        print(f"[measured] shared={share}: logprobs vs HF {diff:.2e} (bound {tol:.2e})")
        assert diff < tol
        assert (got[~valid] == 0).all()


def test_shared_prefix_update_equals_the_update_of_rows_packed_whole(run):
    hf_dir, batch, _, result = run
    assert_same_ppo_step("shared vs whole rows", hf_dir, batch, [result["step_True"]], [result["step_False"]], LR)


@pytest.mark.slow  # a launch of about a minute each
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2_sp", "pp2"])
def test_shared_prefix_under_tensor_and_pipeline_parallelism(run, tp, pp):
    hf_dir, batch, lengths, _ = run
    results = run_ranks(f"{__name__}:shared_rank", tp * pp, {"hf_dir": hf_dir, "batch": batch, "lengths": lengths,
                                                              "tp": tp, "pp": pp}, timeout=420)
    tokens = batch["input_ids"]
    valid = torch.arange(tokens.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
    ref, tol = hf_logprobs(hf_dir, tokens), logprob_bound(hf_dir, tokens, valid)
    checked = 0
    for r in results:
        assert r["shared_calls"] > 0  # every rank holds layers that attended a shared pack
        if r["logprobs_True"] is None:  # off the last pipeline stage
            continue
        diff = ((r["logprobs_True"] - ref).abs() * valid).max().item()
        print(f"[measured] tp{tp} pp{pp} shared: logprobs vs HF {diff:.2e} (bound {tol:.2e})")
        assert diff < tol
        checked += 1
    assert checked == tp
    assert_same_ppo_step(f"tp{tp} pp{pp} shared vs whole rows", hf_dir, batch, [r["step_True"] for r in results],
                         [r["step_False"] for r in results], LR, tp)
