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
from tests.helpers.bounds import logits_bound
from tests.helpers.tiny_models import make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
N, S, LAYERS, EXPERTS, TOPK = 4, 16, 4, 4, 2


def replay_rank(hf_dir: str, tokens, lengths, routes, tp: int, ep: int, pp: int = 1, cp: int = 1):
    import torch.distributed as dist

    from megarl.config import load_unchecked
    from megarl.megatron import router_replay as rr
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.workers import build_options

    init_model_parallel(Layout(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                               pipeline_model_parallel_size=pp, context_parallel_size=cp), seed=1)
    cfg = load_unchecked(data={"model": {"path": hf_dir}, "actor": {"router_replay": {"mode": "R2"}}})
    model, _ = build_and_load(hf_dir, **{**build_options(cfg), "dtype": torch.float32})
    model.eval()
    assert rr.install([model]) == LAYERS // pp  # this stage's routers
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = N // dp
    rows = torch.arange(dp_rank * per, (dp_rank + 1) * per)
    need = rr.need_mask(lengths, S)

    def forward(action, given=None):
        rr.begin(action, N, S, routes=given, need=need, num_layers=LAYERS, topk=TOPK)
        rr.STATE.pass_rows = rows
        # None off the last pipeline stage; packed to each row's length (CP pads every row to 2 * CP past it)
        lp = token_logprobs(model, tokens[rows], micro_batch_size=1, lengths=lengths[rows])
        counts = rr.reduce_counts(rr.end())
        full = torch.zeros(N, S - 1)
        if lp is not None:
            full[rows] = lp
        dist.all_reduce(full)  # every row comes from one last-stage rank (TP and CP ranks agree: take one's)
        return full / (ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size()), counts

    plain, rec_counts = forward("record")
    recorded = rr.gather_recorded()
    r2, r2_counts = forward("replay", recorded)
    forced, forced_counts = forward("replay", routes)
    return {"plain": plain, "recorded": recorded, "r2": r2, "forced": forced,
            "counts": (rec_counts, r2_counts, forced_counts)}


def _hf_forced(hf_dir, tokens, routes, mask=None):
    """HF logprobs with each MoE layer's top-k replaced by `routes` [N, S, L, k] where complete (else HF's own), the
    routes HF's router chose, and the derived float32 bound over mask's positions (tests/helpers/bounds.py)."""
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
    return lp, torch.stack([own[i] for i in range(len(own))], dim=2), logits_bound(hf_dir, logits[:, :-1], mask)


@pytest.mark.slow  # a 2-rank tiny MoE build and 3 forwards per layout: about 90 s each on 2 busy cores
@pytest.mark.parametrize("tp,ep,pp,cp", [(1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
                         ids=["ep2", "tp2_sp", "pp2", "cp2"])
def test_router_replay_matches_hf_forced_routing(tmp_path, tp, ep, pp, cp):
    hf_dir = str(make_tiny_model("qwen3_moe", tmp_path / "moe", seed=0))
    tokens, lengths = sample_tokens(N, S, seed=3, min_len=10)
    g = torch.Generator().manual_seed(7)
    routes = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(N * S * LAYERS)])
    routes = routes.view(N, S, LAYERS, TOPK).to(torch.int16)
    routes[1, 2:5, 1] = -1  # no route: these fall back to the router
    out = run_ranks(f"{__name__}:replay_rank", 2, {"hf_dir": hf_dir, "tokens": tokens, "lengths": lengths,
                                                    "routes": routes, "tp": tp, "ep": ep, "pp": pp, "cp": cp},
                   timeout=600)
    res = out[0]
    mask = torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)
    need = torch.arange(S)[None, :] < (lengths[:, None] - 1)

    hf_plain, hf_own, tol = _hf_forced(hf_dir, tokens, None, mask)
    # no replay: megarl == HF (routing included: a flip at a near tie would be no rounding; the recorded routes are
    # checked to be HF's below), and what it recorded is HF's own top-k at every needed position
    plain = ((res["plain"] - hf_plain).abs() * mask).max().item()
    r2 = ((res["r2"] - res["plain"]).abs() * mask).max().item()
    print(f"[measured] plain vs HF {plain:.2e} (bound {tol:.2e}), R2 vs plain {r2:.2e}")
    assert plain < tol, (plain, tol)
    rec = res["recorded"].long()
    same = (rec.sort(-1).values == hf_own.sort(-1).values).all(-1)  # [N, S, L]
    assert same[need].all()
    rec_counts, r2_counts, forced_counts = res["counts"]
    needed_pairs = int(need.sum()) * LAYERS
    assert rec_counts.needed == needed_pairs  # TP2: each rank counts its own sequence chunk

    # R2 round trip: the same routes, the same computation: the same logprobs (within rounding), 100% agreement,
    # everything replayed
    assert r2 < tol, (r2, tol)
    assert r2_counts.agree == r2_counts.with_route == r2_counts.replayed == r2_counts.needed == needed_pairs

    # other routes: HF forced to them; far from the router's own routing
    hf_forced, hf_forced_own, tol = _hf_forced(hf_dir, tokens, routes, mask)
    forced = ((res["forced"] - hf_forced).abs() * mask).max().item()
    print(f"[measured] forced routes vs HF forced {forced:.2e} (bound {tol:.2e})")
    assert forced < tol, (forced, tol)
    assert ((res["forced"] - res["plain"]).abs() * mask).max() > 1e-2
    missing = int(((routes < 0).any(-1) & need[:, :, None]).sum())
    assert missing == 3 and forced_counts.needed == needed_pairs
    assert forced_counts.replayed == needed_pairs - missing == forced_counts.with_route
    agree = int((same_sets(routes.long(), hf_forced_own) & need[:, :, None] & (routes >= 0).all(-1)).sum())
    assert forced_counts.agree == agree


def same_sets(a, b):
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


LR, CLIP = 1e-3, 0.2


def update_rank(hf_dir: str, batch, routes, tp: int, ep: int):
    """One PPO update with the routes replayed (the update pass of R2/R3): megatron's loss and gradient norm."""
    from megatron.core import parallel_state as ps

    from megarl.config import load_unchecked
    from megarl.config.schema import OptimConfig
    from megarl.megatron import router_replay as rr
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from megarl.megatron.workers import build_options

    init_model_parallel(Layout(tensor_model_parallel_size=tp, expert_model_parallel_size=ep), seed=1)
    cfg = load_unchecked(data={"model": {"path": hf_dir}, "actor": {"router_replay": {"mode": "R2"}}})
    model, spec = build_and_load(hf_dir, **{**build_options(cfg), "dtype": torch.float32})
    rr.install([model])
    trainable = make_trainable(model, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0), total_steps=10)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = N // dp
    rows = torch.arange(dp_rank * per, (dp_rank + 1) * per)
    micro = [{**{k: v[r:r + 1] for k, v in batch.items()}, "row_index": r.view(1)} for r in rows]
    lengths = batch["response_mask"].shape[1] - batch["response_mask"].flip(1).int().argmax(1) + 1
    rr.begin("replay", N, S, routes=routes, need=rr.need_mask(lengths, S), num_layers=LAYERS, topk=TOPK)
    settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP, clip_ratio_high=CLIP)
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    metrics = train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
    counts = rr.reduce_counts(rr.end())
    return {"metrics": metrics, "counts": counts}


@pytest.mark.slow  # a 2-rank tiny MoE update: about 90 s on 2 busy cores
def test_update_with_replayed_routes_equals_hf_forced_routing(tmp_path):
    from megarl import algo

    hf_dir = str(make_tiny_model("qwen3_moe", tmp_path / "moe", seed=0))
    tokens, lengths = sample_tokens(N, S, seed=3, min_len=10)
    mask = torch.zeros(N, S - 1, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, 4: length - 1] = True
    g = torch.Generator().manual_seed(7)
    routes = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(N * S * LAYERS)])
    routes = routes.view(N, S, LAYERS, TOPK).to(torch.int16)
    routes[2, 3:6, 2] = -1
    hf_forced, _, _ = _hf_forced(hf_dir, tokens, routes)
    old = hf_forced + (torch.rand(N, S - 1, generator=g) - 0.5) * 0.4
    adv = torch.randn(N, S - 1, generator=g)
    batch = {"input_ids": tokens, "response_mask": mask, "old_log_probs": old, "advantages": adv}
    (res, *_) = run_ranks(f"{__name__}:update_rank", 2, {"hf_dir": hf_dir, "batch": batch, "routes": routes,
                                                         "tp": 1, "ep": 2}, timeout=600)

    # the reference: HF with the forced routing, PPO loss over the whole batch, torch autograd
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    _force(model, routes)
    logits = model(input_ids=tokens).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss, _ = algo.ppo_clip_loss(old, lp, adv, mask, "token-mean", CLIP, CLIP, 3.0)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    router_grad = sum(float(layer.mlp.gate.weight.grad.abs().sum()) for layer in model.model.layers)
    assert router_grad > 0  # the replayed probabilities carry gradient to the router
    m = res["metrics"]
    print(f"[measured] pg_loss {abs(m['pg_loss'] - loss.item()):.2e} grad_norm rel "
          f"{abs(m['grad_norm'] - grad_norm.item()) / max(1.0, grad_norm.item()):.2e}")
    assert abs(m["pg_loss"] - loss.item()) < 1e-5, (m["pg_loss"], loss.item())
    assert abs(m["grad_norm"] - grad_norm.item()) < 1e-4 * max(1.0, grad_norm.item()), (m["grad_norm"], grad_norm)
    need = torch.arange(S)[None, :] < (lengths[:, None] - 1)
    assert res["counts"].replayed == int(need.sum()) * LAYERS - 3


def _force(model, routes):
    """Replace each HF MoE gate's top-k by `routes` where complete (differentiable through the softmax)."""
    n, s = routes.shape[:2]
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, i=i):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            _, idx = torch.topk(probs, gate.top_k, dim=-1)
            want = routes[:, :, i].reshape(-1, gate.top_k).long()
            idx = torch.where((want >= 0).all(-1, keepdim=True), want.clamp(min=0), idx)
            top = probs.gather(1, idx)
            top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        gate.forward = forward
