"""Reward models on megatron against HF AutoModelForSequenceClassification (float32, within the score bound derived
from the model's widths and depth, tests/helpers/bounds.py):
`megarl verify --hf RM_DIR` at TP1/TP2/PP2 on Qwen2 and Llama reward models, and the RL scorer on a reward model whose
tokenizer and chat template differ from the policy's (responses decoded and re-encoded with the reward model's)."""
import pytest
import torch

from megarl.launch_local import run_ranks
from megarl.verify import main
from tests.helpers.bounds import score_bound, verify_bound
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.parity
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
# two layouts run by default; the rest are slow (each starts its own ranks)
FAST = {("qwen2", 2, 1), ("llama", 1, 2)}


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    return {arch: str(make_tiny_model(arch, tmp / arch, seed=11, head="value")) for arch in ("qwen2", "llama")}


@pytest.mark.parametrize("arch,tp,pp", [
    # the AVX2 tier keeps qwen2 at TP2 (parity_repeat: llama at PP2 runs the same kernels)
    pytest.param(a, tp, pp, marks=(() if a == "qwen2" else pytest.mark.parity_repeat) if (a, tp, pp) in FAST
                 else pytest.mark.slow)
    for a in ("qwen2", "llama") for tp, pp in LAYOUTS])
def test_verify_reward_model_scores_match_hf(reward_models, capsys, arch, tp, pp):
    _check_scores(reward_models, capsys, arch, ["--tp", str(tp), "--pp", str(pp)], f"tp{tp} pp{pp}")


# a value head at context parallelism: each row's last real token sits on one CP rank, its score gathered for all
@pytest.mark.parity_repeat
def test_verify_reward_model_scores_match_hf_at_cp2(reward_models, capsys):
    _check_scores(reward_models, capsys, "qwen2", ["--cp", "2"], "cp2")


def _check_scores(reward_models, capsys, arch, layout, label):
    code = main(["--hf", reward_models[arch], "--seq-len", "24", "--batch", "3", "--micro-batch", "2"] + layout)
    out = capsys.readouterr().out
    assert "HF score" in out and "max abs score difference" in out
    diff = float(out.split("max abs score difference ")[1].split()[0])
    tol = verify_bound(reward_models[arch], 24, 3, score=True)
    print(f"[measured] {arch} {label}: scores vs HF {diff:.2e} (bound {tol:.2e})")
    assert code == 0 and diff <= tol, out
    scores = [float(line.split()[3]) for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(scores) == 3 and len({round(s, 4) for s in scores}) == 3  # real, distinct scores, not all 0


def score_rollout_rank(rm_dir: str, policy_dir: str, tp: int, pp: int, prompts, responses):
    """Rank body: RewardModelScorer (TP tp, PP pp) on a rollout sampled by the policy's tokenizer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megarl.config import MegarlConfig
    from megarl.data import PromptRecord, encode_one
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.reward.model import RewardModelScorer
    from megarl.runtime import Runtime
    from megarl.types import RolloutBatch

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    cfg = MegarlConfig.model_validate({
        "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        "trainer": {"n_gpus_per_node": tp * pp}, "model": {"dtype": "float32"},
        "reward": {"reward_model": {"enable": True, "path": rm_dir, "micro_batch_size_per_gpu": 2}}})
    policy = AutoTokenizer.from_pretrained(policy_dir)
    records = [PromptRecord(index=i, uid=str(i), prompt=[{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
    prompt_ids = [encode_one(r, policy) for r in records]
    resp = [policy.encode(t, add_special_tokens=False) + [policy.eos_token_id] for t in responses]
    width = max(len(r) for r in resp)
    response_ids = torch.full((len(resp), width), policy.pad_token_id)
    for i, r in enumerate(resp):
        response_ids[i, :len(r)] = torch.tensor(r)
    n = len(resp)
    rollout = RolloutBatch(prompt_ids=prompt_ids, response_ids=response_ids,
                           response_lengths=torch.tensor([len(r) for r in resp]), rollout_logprobs=None,
                           finish_reasons=["stop"] * n, truncated=torch.zeros(n, dtype=torch.bool),
                           prompt_index=torch.arange(n), prompt_truncated=torch.zeros(n, dtype=torch.bool),
                           weight_version=0, pad_token_id=policy.pad_token_id)
    rt = Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=ps.get_data_parallel_rank(),
                 dp_size=ps.get_data_parallel_world_size(), run_dir=None)
    scorer = RewardModelScorer(cfg, policy)
    scores, _ = scorer.score(rollout, records, rt)
    return {"reencodes": scorer.reencodes, "scores": scores}


@pytest.mark.parametrize("tp,pp", [pytest.param(2, 1, marks=pytest.mark.parity_repeat),
                                   pytest.param(1, 2, marks=pytest.mark.slow)])
def test_scorer_reencodes_for_a_reward_model_with_another_tokenizer(reward_models, tmp_path, tp, pp):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.data import arithmetic_tokenizer

    policy_dir = tmp_path / "policy_tok"
    arithmetic_tokenizer(str(policy_dir), max_operand=20)  # word-level vocab, its own chat template
    prompts = ["What is 3 + 4 ?", "What is 12 + 9 ?", "What is 0 + 20 ?"]
    responses = ["#### 7", "#### 20", "The answer is 20"]
    rm_dir = reward_models["qwen2"]  # byte-level BPE, ChatML-style template
    out = run_ranks(f"{__name__}:score_rollout_rank", tp * pp,
                    {"rm_dir": rm_dir, "policy_dir": str(policy_dir), "tp": tp, "pp": pp, "prompts": prompts,
                     "responses": responses}, timeout=600)
    assert all(o["reencodes"] for o in out)
    got = out[0]["scores"]
    for o in out:  # every rank holds the same scores
        assert torch.equal(o["scores"], got)
    # the reference: the texts as the reward model's own tokenizer and chat template render them, scored by HF
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32, attn_implementation="eager")
    want, longest = [], 0
    for p, r in zip(prompts, responses):
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"] + tok(r, add_special_tokens=False)["input_ids"] + \
            [tok.eos_token_id]
        longest = max(longest, len(ids))
        with torch.no_grad():
            want.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    tol = score_bound(rm_dir, want, longest)
    print(f"[measured] scorer vs HF {(got - torch.tensor(want)).abs().max().item():.2e} (bound {tol:.2e})")
    assert torch.allclose(got, torch.tensor(want), atol=tol, rtol=0), (got, want, tol)
