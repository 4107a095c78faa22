"""MoE routing replay (actor.router_replay.mode) on a tiny Qwen3-MoE at trainer EP2 and TP2 (sequence parallel), each
rank forwarding its own rows (the per-rank delivery of the batch).

The independent reference is HF transformers with its router's top-k replaced by the given experts (the gate's
softmax probabilities at those experts, renormalised: Qwen3-MoE's norm_topk_prob), computed here, not by megarl:
- no replay: megarl's logprobs match plain HF and the recorded routing is HF's own top-k (100% of needed tokens);
- R2 round trip: replaying the recorded routing gives the same logprobs, agreement 100%, every needed token replayed;
- replaying other routes (random experts, a few tokens without a route): logprobs match HF forced to those routes
  (tokens without a route use HF's own router), far from the unreplayed ones; the fallback share is counted exactly.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model, sample_tokens

N, S, LAYERS, EXPERTS, TOPK = 4, 16, 4, 4, 2


def replay_rank(hf_dir: str, tokens, lengths, routes, tp: int, ep: int):
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.megatron import router_replay as rr
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.workers import build_options

    init_model_parallel(Layout(tensor_model_parallel_size=tp, expert_model_parallel_size=ep), seed=1)
    cfg = load_config(data={"model": {"path": hf_dir}, "actor": {"router_replay": {"mode": "R2"}}}, check=False)
    model, _ = build_and_load(hf_dir, **{**build_options(cfg), "dtype": torch.float32})
    model.eval()
    assert rr.install([model]) == LAYERS
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = N // dp
    rows = torch.arange(dp_rank * per, (dp_rank + 1) * per)
    need = rr.need_mask(lengths, S)

    def forward(action, given=None):
        rr.begin(action, N, S, routes=given, need=need, num_layers=LAYERS, topk=TOPK)
        rr.STATE.pass_rows = rows
        lp = token_logprobs(model, tokens[rows], micro_batch_size=1)
        counts = rr.reduce_counts(rr.end())
        full = torch.zeros(N, S - 1)
        full[rows] = lp
        dist.all_reduce(full, group=ps.get_data_parallel_group())
        return full, counts

    plain, rec_counts = forward("record")
    recorded = rr.gather_recorded()
    r2, r2_counts = forward("replay", recorded)
    forced, forced_counts = forward("replay", routes)
    return {"plain": plain, "recorded": recorded, "r2": r2, "forced": forced,
            "counts": (rec_counts, r2_counts, forced_counts)}


def _hf_forced(hf_dir, tokens, routes):
    """HF logprobs with each MoE layer's top-k replaced by `routes` [N, S, L, k] where complete (else HF's own)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    own = {}
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, i=i):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            own[i] = idx.view(tokens.shape[0], tokens.shape[1], -1).clone()
            if routes is not None:
                want = routes[:, :, i].reshape(-1, gate.top_k).long()
                has = (want >= 0).all(-1, keepdim=True)
                idx = torch.where(has, want.clamp(min=0), idx)
                top = probs.gather(1, idx)
            top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        gate.forward = forward
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return lp, torch.stack([own[i] for i in range(len(own))], dim=2)


@pytest.mark.slow  # a 2-rank tiny MoE build and 3 forwards per layout: about 90 s each on 2 busy cores
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)], ids=["ep2", "tp2_sp"])
def test_router_replay_matches_hf_forced_routing(tmp_path, tp, ep):
    hf_dir = str(make_tiny_model("qwen3_moe", tmp_path / "moe", seed=0))
    tokens, lengths = sample_tokens(N, S, seed=3, min_len=10)
    g = torch.Generator().manual_seed(7)
    routes = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(N * S * LAYERS)])
    routes = routes.view(N, S, LAYERS, TOPK).to(torch.int16)
    routes[1, 2:5, 1] = -1  # no route: these fall back to the router
    out = run_ranks(f"{__name__}:replay_rank", 2, {"hf_dir": hf_dir, "tokens": tokens, "lengths": lengths,
                                                    "routes": routes, "tp": tp, "ep": ep}, timeout=600)
    res = out[0]
    mask = torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)
    need = torch.arange(S)[None, :] < (lengths[:, None] - 1)

    hf_plain, hf_own = _hf_forced(hf_dir, tokens, None)
    # no replay: megarl == HF, and what it recorded is HF's own top-k at every needed position
    assert ((res["plain"] - hf_plain).abs() * mask).max() < 1e-4
    rec = res["recorded"].long()
    same = (rec.sort(-1).values == hf_own.sort(-1).values).all(-1)  # [N, S, L]
    assert same[need].all()
    rec_counts, r2_counts, forced_counts = res["counts"]
    needed_pairs = int(need.sum()) * LAYERS
    assert rec_counts.needed == needed_pairs  # TP2: each rank counts its own sequence chunk

    # R2 round trip: same logprobs, 100% agreement, everything replayed
    assert ((res["r2"] - res["plain"]).abs() * mask).max() < 1e-5
    assert r2_counts.agree == r2_counts.with_route == r2_counts.replayed == r2_counts.needed == needed_pairs

    # other routes: HF forced to them; far from the router's own routing
    hf_forced, hf_forced_own = _hf_forced(hf_dir, tokens, routes)
    assert ((res["forced"] - hf_forced).abs() * mask).max() < 1e-4
    assert ((res["forced"] - res["plain"]).abs() * mask).max() > 1e-2
    missing = int(((routes < 0).any(-1) & need[:, :, None]).sum())
    assert missing == 3 and forced_counts.needed == needed_pairs
    assert forced_counts.replayed == needed_pairs - missing == forced_counts.with_route
    agree = int((same_sets(routes.long(), hf_forced_own) & need[:, :, None] & (routes >= 0).all(-1)).sum())
    assert forced_counts.agree == agree


def same_sets(a, b):
    return (a.sort(-1).values == b.sort(-1).values).all(-1)
