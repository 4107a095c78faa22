"""`megarl plan --search`: every layout of a recipe on a cluster, the ones `megarl validate` accepts, the ones that fit
with a margin, ranked by planned step time.

The space: trainer TP (powers of two up to a node), PP (powers of two and the recipe's, uneven first/last stages where
the layers do not split), CP 1/2/4/8 (where TP*PP*CP divides the trainer's ranks; of each layout only the smallest CP
that fits is planned, and none past a CP at which every setting is over without its per-token bytes), VPP 1/2, EP and
expert TP (MoE), micro-batch or token budget, recompute, offload, the distributed optimizer; engine TP/EP (up to
a node: validate refuses a replica wider than one) and replicas, colocated or on nodes of their own (the
trainer/engine node split).
The rules are validate's own (megarl.validate.CHECKS' layout rules, called on each candidate's config): a family of
layouts that one of them refuses is reported once with that rule ("TP 16: must divide num_key_value_heads = 8").
Memory and time are the planner's (plan_steps with megarl.plan.counts standing in for the sync plan;
megarl.plan.timing), the same for every candidate and for the recipe's own layout, so the comparison is like for like.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import product
from typing import Optional

from megarl.plan.model import GIB, Cluster, PlanError
from megarl.plan.phases import TOKEN_LINES
from megarl.plan.timing import (DEFAULT_GPU, Calibration, Gpu, StepTime, active_parameters, assumptions,
                                attention_flops, dispatcher_seconds, effective_mfu, generate_seconds,
                                recompute_factor, trainer_seconds)

P, A, R = "parallelism.", "actor.", "rollout."
CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)


@dataclass
class Candidate:
    settings: dict  # dotted key -> value, what differs from the recipe
    peak: int
    phase: str
    host: int
    time: StepTime
    reasons: list
    per_token: int = 0  # the bytes of its peak phase that follow the tokens per rank (activations, logits)


@dataclass
class SearchResult:
    enumerated: int = 0
    valid: int = 0
    fitting: int = 0
    seconds: float = 0.0
    best: list = field(default_factory=list)  # Candidates, fastest first, validated
    own: Optional[Candidate] = None
    rejected: dict = field(default_factory=dict)  # family label -> why
    planned: int = 0  # layouts whose memory and time were planned
    calibration: Optional[Calibration] = None  # measured trainer throughput the times used
    gpu: Gpu = DEFAULT_GPU  # the GPU kind the times assume


def with_settings(cfg, settings: dict):
    """A copy of cfg with dotted keys set (no re-validation: the search runs validate's rules itself)."""
    nested: dict = {}
    for key, value in settings.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _apply(cfg, nested)


def _apply(obj, nested: dict):
    update = {k: (_apply(getattr(obj, k), v) if isinstance(v, dict) else v) for k, v in nested.items()}
    out = obj.model_copy(update=update)
    if hasattr(obj, "_warnings"):
        out._warnings = []
    return out


def _pow2(limit: int) -> list:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def stage_splits(layers: int, pp: int) -> list:
    """(first, last) stage sizes: None, None where PP divides the layers, else the balanced uneven split(s)."""
    if layers % pp == 0:
        return [(None, None)]
    if pp == 2:
        return [(layers // 2, None)]
    mid = -(-layers // pp)
    rest = layers - (pp - 2) * mid
    out = []
    for first in sorted({1, rest // 2}):
        last = rest - first
        if 1 <= first <= mid and 1 <= last <= mid + 1:
            out.append((first, last))
    return out


def layout_checks():
    """megarl validate's rules that read the layout, batches and engines (imported, not copied)."""
    from megarl.validate import (check_batches, check_device, check_engine_layout, check_layout, check_lora,
                                 check_model_layout, check_parallel_options, check_router_replay, check_trainer_mode,
                                 check_virtual_pipeline)

    return (check_layout, check_model_layout, check_parallel_options, check_virtual_pipeline, check_batches,
            check_router_replay, check_lora, check_device, check_engine_layout, check_trainer_mode)


def first_issue(cfg, checks) -> Optional[str]:
    for check in checks:
        for issue in check(cfg):
            if not issue.warning:
                return issue.rule
    return None


def trainer_families(cfg, spec, gpus_per_node: int, world: int) -> list:
    """(label, settings) of every trainer layout the space holds at `world` ranks."""
    p = cfg.parallelism
    pps = sorted({x for x in _pow2(min(spec.num_layers, world)) if x <= 32} | {p.pipeline_model_parallel_size})
    eps = _pow2(min(spec.num_experts, world)) if spec.is_moe else [1]
    out = []
    for tp, pp, ep in product(_pow2(gpus_per_node), pps, eps):
        for first, last in stage_splits(spec.num_layers, pp):
            for vpp in ([None, 2] if pp > 1 and first is None else [None]):
                for etp in (sorted({1, tp}) if spec.is_moe else [None]):
                    # CP last: a layout's CPs follow each other, smallest first (search plans the smallest that fits)
                    for cp in [c for c in CONTEXT_PARALLEL_SIZES if c == 1 or world % (tp * pp * c) == 0]:
                        s = {P + "tensor_model_parallel_size": tp, P + "pipeline_model_parallel_size": pp,
                             P + "context_parallel_size": cp,
                             P + "expert_model_parallel_size": ep, P + "expert_tensor_parallel_size": etp,
                             P + "virtual_pipeline_model_parallel_size": vpp, P + "sequence_parallel": tp > 1,
                             P + "num_layers_in_first_pipeline_stage": first,
                             P + "num_layers_in_last_pipeline_stage": last}
                        split = (f" ({first}+{spec.num_layers - first})" if last is None else
                                 f" ({first}+...+{last})") if first else ""
                        label = f"TP {tp} PP {pp}" + split + (f" CP {cp}" if cp > 1 else "") + \
                            (f" VPP {vpp}" if vpp else "") + (f" EP {ep} ETP {etp}" if spec.is_moe else "")
                        out.append((label, s))
    return out


def _without_cp(settings: dict) -> tuple:
    """A trainer layout's settings but its CP: the layout whose smallest fitting CP the search keeps."""
    return tuple((k, v) for k, v in settings.items() if k != P + "context_parallel_size")


def engine_options(cfg, spec, nodes: int, gpus_per_node: int) -> list:
    """(label, settings, trainer nodes) of every engine layout that can start: engine TP up to a node's GPUs (an engine
    replica must fit in one node, megarl.rollout.checks.ONE_NODE_RULE), colocated over all nodes, or on nodes of
    their own."""
    out = []
    # colocated engines sleep where the recipe's do, or where it had them on nodes of their own
    sleep = cfg.rollout.enable_sleep_mode or cfg.engine_placement == "separate"
    for etp in _pow2(gpus_per_node):
        for eep in (sorted({1, etp}) if spec.is_moe else [1]):
            base = {R + "tensor_model_parallel_size": etp, R + "expert_model_parallel_size": eep}
            out.append((f"engine TP {etp} EP {eep}, colocated",
                        {**base, R + "mode": "colocated", R + "placement": None, R + "data_parallel_size": None,
                         R + "enable_sleep_mode": sleep, "trainer.nnodes": nodes}, nodes))
            # the recipe's own split too: a quarter's node counts rarely divide a batch as a recipe's do
            own = {cfg.trainer.nnodes} if cfg.engine_placement == "separate" else set()
            for t in sorted({max(1, nodes * k // 4) for k in (1, 2, 3)} | own):
                engine_gpus = (nodes - t) * gpus_per_node
                if t >= nodes or engine_gpus < etp:
                    continue
                out.append((f"engine TP {etp} EP {eep}, separate on {nodes - t} node(s)",
                            {**base, R + "placement": "separate", R + "data_parallel_size": engine_gpus // etp,
                             R + "enable_sleep_mode": False, "trainer.nnodes": t}, t))
    return out


def knob_options(cfg, ep: int) -> list:
    """Micro-batch or token budget (as the recipe batches; token budgets at EP too, their count agreed over the
    group), recompute, offload and the distributed optimizer, the recipe's own included."""
    a = cfg.actor
    recomputes = ["none", "selective", "full"]
    offloads = [False, True]
    if not a.use_dynamic_bsz:
        micros = sorted({1, 2, 4, a.ppo_micro_batch_size_per_gpu})
        batch = [{A + "use_dynamic_bsz": False, A + "ppo_micro_batch_size_per_gpu": m,
                  R + "log_prob_use_dynamic_bsz": False} for m in micros]
    else:
        t = a.ppo_max_token_len_per_gpu
        budgets = sorted({t // 2, t, t * 2})
        batch = [{A + "ppo_max_token_len_per_gpu": b} for b in budgets]
    dist = sorted({True, cfg.parallelism.use_distributed_optimizer}, reverse=True)
    out = []
    for b, rc, off, d in product(batch, recomputes, offloads, dist):
        k = {**b, "model.recompute": rc, A + "offload": _offload(off), P + "use_distributed_optimizer": d}
        if cfg.critic_enabled:
            k["critic.offload"] = _offload(off)
        out.append(k)
    return out


def _offload(on: bool):
    from megarl.config.schema import OffloadConfig

    return OffloadConfig(params=on, grads=on, optimizer=on)


def step_time(cfg, steps, gpus_per_node: int, calibration: Optional[Calibration] = None,
              gpu: Gpu = DEFAULT_GPU, link_gbps: float = 50.0) -> StepTime:
    """The planned seconds of one step of this layout (megarl.plan.timing; measured trainer throughput where
    calibrated)."""
    from megarl.plan.phases import host_round_trip_seconds

    pl, w, e, r = steps.place, steps.weights, steps.engine, cfg.rollout
    spec = w.spec
    active = active_parameters(w.n_params, w.n_expert, spec.moe_topk, spec.num_experts)
    rows, seq = cfg.data.train_batch_size * r.n, r.prompt_length + r.response_length
    tokens = rows * seq
    gen = generate_seconds(rows, pl.replicas, r.prompt_length, r.response_length, r.max_num_seqs, e.kv_tokens,
                           e.weights, e.kv_per_token, spec.num_layers, pl.engine_tp, gpus_per_node, active, gpu,
                           attention_flops(spec, 1, r.prompt_length))
    mbs = steps.roles.actor_micro_batches
    attention = attention_flops(spec, rows, seq)
    forwards = 1 + cfg.ref_enabled + cfg.critic_enabled
    fwd = trainer_seconds(active, tokens, pl.world, forwards, effective_mfu("forward", calibration, gpu), pl.tp,
                          pl.ep, pl.pp, mbs, pl.vpp, pl.cp, gpu, attention)
    passes = 3 * recompute_factor(cfg.model.recompute) * (cfg.actor.ppo_epochs +
                                                           (cfg.critic.ppo_epochs if cfg.critic_enabled else 0))
    upd = trainer_seconds(active, tokens, pl.world, passes, effective_mfu("update", calibration, gpu), pl.tp, pl.ep,
                          pl.pp, mbs, pl.vpp, pl.cp, gpu, attention)
    # the dispatcher's collectives: 2 per MoE layer in a forward, 4 in a forward and backward (+2 recomputed)
    # megatron numbers an expert TP x EP group's ranks consecutively: it spans nodes once it is wider than one
    cross = pl.layout.expert_tensor * pl.ep > gpus_per_node
    recomputed = 2 if cfg.model.recompute == "full" else 0
    per_update = (4 + recomputed) * (cfg.actor.ppo_epochs + (cfg.critic.ppo_epochs if cfg.critic_enabled else 0))
    sp = cfg.parallelism.sequence_parallel
    disp = [dispatcher_seconds(spec, tokens, pl.dp, pl.cp, pl.tp, sp, pl.layout.expert_tensor, pl.ep, pl.pp, n,
                               pl.pbytes, cross, link_gbps, gpu) for n in (2 * forwards, per_update)]
    off = host_round_trip_seconds(steps.offloaded[steps.peak.stage])
    return StepTime(gen, fwd + disp[0], upd + disp[1], steps.sync.seconds, off)


def knob_bound(cfg, c, steps_forward: float, active: float, calibration: Optional[Calibration] = None,
               gpu: Gpu = DEFAULT_GPU) -> float:
    """A lower bound of the trainer seconds of config c (a family's layout with one knob setting), from what the knobs
    change in the time model without planning its memory: the recompute factor and the pipeline bubble of its
    micro-batch count; the offload's round trip (>= 0) and everything the knobs do not change are left out. The
    search plans a family's knobs in this order and stops where the bound passes the fastest fitting one."""
    from megarl.plan.memory import batches

    p, a, r = c.parallelism, c.actor, c.rollout
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    world = c.world_size
    dp = max(1, world // (tp * pp * cp))
    b = batches(c, dp)
    _, mbs = b.micro(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu * cp)
    tokens = c.data.train_batch_size * r.n * (r.prompt_length + r.response_length)
    passes = 3 * recompute_factor(c.model.recompute) * (a.ppo_epochs + (c.critic.ppo_epochs if c.critic_enabled
                                                                        else 0))
    vpp = p.virtual_pipeline_model_parallel_size or 1
    return steps_forward + trainer_seconds(active, tokens, world, passes, effective_mfu("update", calibration, gpu),
                                           tp, p.expert_model_parallel_size, pp, mbs, vpp, cp, gpu)


def search(cfg, nodes: int, gpus_per_node: int, gpu_mem_gib: float, link_gbps: float, host_mem_gib: float,
           top: int = 5, margin: float = 0.10, pool: int = 16,
           calibration: Optional[Calibration] = None, gpu: Gpu = DEFAULT_GPU) -> SearchResult:
    """Every layout of cfg's space on the cluster; the `top` fastest that validate accepts and fit with `margin` of
    each GPU free; the recipe's own layout planned the same way.

    Two stages keep it to seconds: (1) at each trainer size, every trainer layout and knob setting is checked by
    validate's rules, and each layout family is planned in the order of its knobs' cost until one fits (with an
    engine of the recipe's shape); (2) the `pool` fastest of those are planned with every engine option. The
    recipe's own layout is always among the ranked, so the best is never worse on these figures."""
    from megarl.bridge.hf_config import spec_from_dict
    from megarl.plan.planner import plan_steps
    from megarl.plan.counts import counted_weights
    from megarl.plan.model import read_model_config
    from megarl.validate import run_checks

    started = time.perf_counter()
    cluster = Cluster(nodes, gpus_per_node, gpu_mem_gib, link_gbps)
    hf = read_model_config(cfg)
    spec = spec_from_dict(hf)
    checks = layout_checks()
    budget = cluster.gpu_bytes * (1 - margin)
    res = SearchResult(calibration=calibration, gpu=gpu)
    from megarl.plan.counts import profile

    prof = profile(hf)
    active = active_parameters(prof.total, prof.expert_total, spec.moe_topk, spec.num_experts)

    def evaluate(c, settings) -> Candidate:
        st = plan_steps(c, cluster, hf, host_mem_gib, counted_weights)
        host = max(sum(v.values()) for v in st.host.values())
        per_token = sum(st.peak.lines[st.peak.phase].get(k, 0) for k in TOKEN_LINES)
        return Candidate(settings, st.peak.bytes, st.peak.phase, host,
                         step_time(c, st, gpus_per_node, calibration, gpu, link_gbps), st.reasons, per_token)

    def fits(cand: Candidate) -> bool:
        return not cand.reasons and cand.peak <= budget

    res.own = evaluate(cfg, {})
    ranked = [(res.own, cfg)] if fits(res.own) else []
    by_world: dict = {}
    for elabel, esettings, tnodes in engine_options(cfg, spec, nodes, gpus_per_node):
        why = first_issue(with_settings(cfg, esettings), checks[-2:])
        if why:
            res.rejected.setdefault(elabel, why)
        by_world.setdefault(tnodes, []).append((elabel, esettings, why is None))
    planned = 0
    for tnodes, engines in by_world.items():
        good = [e for e in engines if e[2]]
        families = trainer_families(cfg, spec, gpus_per_node, tnodes * gpus_per_node)
        knobs_of = {ep: knob_options(cfg, ep) for ep in {1, 2}}
        res.enumerated += sum(len(knobs_of[min(2, f[P + "expert_model_parallel_size"])]) for _, f in families) * \
            len(engines)
        if not good:
            continue
        probe = min(good, key=lambda e: (e[1][R + "tensor_model_parallel_size"] !=
                                         cfg.rollout.tensor_model_parallel_size, e[0]))[1]
        first_fits, settled = [], set()  # layouts (less their CP) that a larger CP would not change: skipped
        for flabel, fsettings in families:
            if _without_cp(fsettings) in settled:
                continue
            base = {**probe, **fsettings}
            why = first_issue(with_settings(cfg, base), checks[:3])
            if why:
                res.rejected.setdefault(flabel, why)
                continue
            found, knob_why, smallest, floor = None, None, None, None
            # every knob setting validate accepts, planned in the order of its lower-bound time until the bound
            # passes the fastest that fits (so the family's best by the time model, whatever the knob)
            bounded = []
            for k in knobs_of[min(2, fsettings[P + "expert_model_parallel_size"])]:
                c = with_settings(cfg, {**base, **k})
                why = first_issue(c, checks[3:-2])
                if why:
                    knob_why = knob_why or why
                    continue
                res.valid += len(good)
                bounded.append((knob_bound(cfg, c, 0.0, active, calibration, gpu), len(bounded), c, k))
            for bound, _, c, k in sorted(bounded, key=lambda x: x[:2]):
                if found is not None and bound >= found.time.forwards + found.time.update + found.time.offload:
                    break
                planned += 1
                try:
                    cand = evaluate(c, {**fsettings, **k})
                except (PlanError, ValueError) as exc:
                    res.rejected.setdefault(flabel, str(exc))
                    break
                if fits(cand):
                    if found is None or trainer_time(cand) < trainer_time(found):
                        found = cand
                    settled.add(_without_cp(fsettings))  # the smallest CP that fits
                else:
                    floor = min(floor if floor is not None else cand.peak, cand.peak - cand.per_token)
                    if smallest is None or cand.peak < smallest.peak:
                        smallest = cand
            if found is not None:
                first_fits.append(found)
            if found is None and floor is not None and floor > budget:
                # over even without its per-token bytes, which are all that a larger CP divides (the states per GPU
                # stay: DP x CP is the same)
                settled.add(_without_cp(fsettings))
            if found is None and flabel not in res.rejected:
                res.rejected[flabel] = knob_why if smallest is None else (
                    f"no micro-batch, recompute or offload setting fits: at best {smallest.peak / GIB:.1f} GiB in "
                    f"{smallest.phase}" + (f" ({smallest.reasons[0].split(';')[0][:100]})" if smallest.reasons
                                           and not smallest.reasons[0].startswith("memory") else ""))
        first_fits.sort(key=trainer_time)
        for trainer in first_fits[:pool]:
            for elabel, esettings, ok in good:
                settings = {**trainer.settings, **esettings}
                c = with_settings(cfg, settings)
                planned += 1
                cand = evaluate(c, _diff(cfg, settings))
                if fits(cand):
                    res.fitting += 1
                    ranked.append((cand, c))
    res.planned = planned
    ranked.sort(key=lambda x: (x[0].time.total, x[1].parallelism.context_parallel_size))
    seen = set()
    for cand, c in ranked:
        key = tuple(sorted(cand.settings.items(), key=str))
        if len(res.best) >= top or key in seen:
            continue
        seen.add(key)
        if not [i for i in run_checks(c) if not i.warning]:
            res.best.append(cand)
    res.seconds = time.perf_counter() - started
    return res


def _value(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _diff(cfg, settings: dict) -> dict:
    """The settings whose values differ from the recipe's (offload sections as their three booleans)."""
    out = {}
    for key, value in settings.items():
        old = _value(cfg, key)
        if key.endswith(".offload") and hasattr(value, "params"):
            for f in ("params", "grads", "optimizer"):
                if getattr(value, f) != getattr(old, f):
                    out[f"{key}.{f}"] = getattr(value, f)
        elif value != old:
            out[key] = value
    return out


def trainer_time(c: Candidate) -> float:
    """The seconds of a candidate that its trainer layout and knobs decide (its engine's are planned after)."""
    return c.time.forwards + c.time.update + c.time.offload


def overrides(settings: dict) -> list:
    return [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def render(res: SearchResult, cluster_line: str, gpu_bytes: int) -> str:
    lines = [cluster_line,
             f"layouts enumerated {res.enumerated:,}, valid {res.valid:,}, planned {res.planned:,}, fitting "
             f"{res.fitting:,} of the planned with all engines (searched in {res.seconds:.1f} s)",
             assumptions(res.calibration, res.gpu), ""]

    def row(name, c):
        t = c.time
        free = gpu_bytes - c.peak
        return (f"{name}: step {t.total:.4g} s (generate {t.generate:.3g}, forwards {t.forwards:.3g}, update "
                f"{t.update:.3g}, sync {t.sync:.3g}, offload {t.offload:.3g}); peak {c.peak / GIB:.1f} of "
                f"{gpu_bytes / GIB:g} GiB in {c.phase}, headroom {free / GIB:.1f} GiB ({free / gpu_bytes:.0%}); "
                f"host {c.host / GIB:.0f} GiB/node")

    own = res.own
    lines.append(row("recipe's own", own) + ("" if not own.reasons else f"; DOES NOT FIT: {own.reasons[0][:160]}"))
    for i, c in enumerate(res.best):
        up, first = res.best[i - 1].time.total, res.best[0].time.total
        gap = "" if i == 0 else (f"; margin {c.time.total - up:+.3g} s ({c.time.total / up - 1:+.2%}) over #{i}"
                                 + ("" if i == 1 else f", {c.time.total - first:+.3g} s ({c.time.total / first - 1:+.2%})"
                                    " over #1"))
        lines.append(row(f"#{i + 1}", c) + gap)
        lines.append("    " + (" ".join(overrides(c.settings)) or "(the recipe's own settings)"))
    if not res.best:
        lines.append("no layout fits with the margin; see the rejected families below")
    if res.rejected:
        lines += ["", f"rejected ({len(res.rejected)} families), first rule each refused:"]
        shown = list(res.rejected.items())[:25]
        lines += [f"  {k}: {v}" for k, v in shown]
        if len(res.rejected) > len(shown):
            lines.append(f"  ... and {len(res.rejected) - len(shown)} more")
    return "\n".join(lines)


def write_recipe(recipe: str, settings: dict, out: str) -> None:
    """The recipe with the chosen settings written in (a YAML file)."""
    import yaml

    data = yaml.safe_load(open(recipe)) or {}
    for key, value in settings.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else \
                node.__setitem__(part, {}) or node[part]
        node[leaf] = value
    with open(out, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
