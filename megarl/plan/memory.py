"""Memory per role: the per-GPU bytes of actor, critic, reference and reward model on each pipeline stage.

The memory model (bytes per GPU; P = parameters this rank holds, from the sync plan)
* Trainable model (actor; critic with a 1-wide value head instead of the LM head):
    parameters      P * 2 (bf16) or 4 (fp32)
    gradients       P * 4 (megarl reduces gradients in fp32: grad_reduce_in_fp32)
    optimizer       Adam: fp32 master copy (4 B/param in bf16, none in fp32) + exp_avg + exp_avg_sq (8 B/param),
                    each a named line; with the distributed optimizer divided by the DP x CP size (dense
                    parameters: CP ranks hold the same weights, as DP ranks do) or the expert-data-parallel size
                    world / (expert TP * EP * PP) (expert parameters; megatron folds CP into it).
    activations     per token per layer, in 16-bit elements (x 2 in float32), flash attention (no score matrix),
                    SwiGLU, GQA, no dropout:
                    8h (norm inputs and residual stream, /TP with sequence parallel) + (4q + 4kv + 6f) / TP
                    with q = heads*head_dim, kv = kv_heads*head_dim, f = FFN size; MoE: f-term -> top_k * (2h + 6f_moe)
                    / expert TP. selective recompute drops the attention output (2q); full recompute keeps only each
                    layer's input (2h, /TP with SP) plus one layer's full activations being recomputed.
                    1F1B pipeline: stage s holds min(PP - s, micro-batches) micro-batches in flight; interleaved
                    1F1B (virtual pipeline stages) more, in chunks of layers/(PP*VPP) (see in_flight_layers). The
                    last stage adds the logits of the log-prob / entropy pass and their backward
                    (megarl.plan.terms.update_logits_bytes, on the padded vocabulary).
                    Tokens are one rank's: a micro-batch's split over CP ranks, each row
                    padded to a multiple of 2 * CP (megarl.plan.terms.cp_rank_tokens); a token budget
                    (*_max_token_len_per_gpu) is per GPU, so a micro-batch holds CP times it. Context-parallel
                    attention adds a one-layer transient (megarl.plan.terms.cp_attention_bytes), a line of its own;
                    without TE and without recompute each layer also stores the K/V gathered over CP (cp_saved_kv).
                    A micro-batch's tokens (Lengths): by default the worst case, every row at full length (prompt +
                    response); given the measured responses (mean N, longest M: `megarl plan --response-lengths`),
                    rows are packed, so m rows of a fixed micro-batch hold (m - 1) x (prompt + N) + (prompt + M)
                    tokens (the micro-batch holding the longest row) and a token budget holds at least the longest row.
* LoRA actor: the frozen base's parameters, plus the adapters with their gradients and optimizer states.
* Reference: parameters only; the old/ref log-prob forwards add the logits of one forward micro-batch on the last stage
  (megarl.plan.terms.forward_logits_bytes), unless no policy forward runs there (an on-policy step without reference).
* Reward model (reward.reward_model.enable): parameters only (frozen, at the trainer's layout), counted from its
  config.json (the policy's shape when it does not exist yet): embedding on the first stage, layers split over PP,
  attention and MLP over TP, experts over EP, a 1-wide head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megarl.bridge.hf_config import CONFIG_FILE, ArchSpec, BridgeError, spec_from_dict
from megarl.bridge.mapping import padded_vocab_size
from megarl.plan.model import Placement, PlanError, Weights, read_json
from megarl.plan.terms import (OPTIMIZER_FOREACH, OPTIMIZER_FUSED, OPTIMIZER_SINGLE, attention_kv_bytes,
                               attention_out_bytes, backward_mlp_transient_bytes, cp_attention_bytes,
                               cp_block_scores_bytes, cp_rank_tokens, foreach_adam_step_bytes, forward_logits_bytes,
                               is_moe_layer, moe_dispatcher_bytes, moe_gathered_tokens, moe_routed_units_per_token,
                               moe_shared_units_per_token, update_logits_bytes)
from megarl.sync.plan import DTYPE_BYTES


@dataclass
class ModelMemory:
    """One trainable or frozen model's per-GPU bytes on the most loaded rank of each pipeline stage."""

    name: str
    params: list[int]  # per stage
    grads: list[int] = field(default_factory=list)
    optim: list[int] = field(default_factory=list)
    optim_distributed: list[int] = field(default_factory=list)
    optim_replicated: list[int] = field(default_factory=list)
    activations: list[int] = field(default_factory=list)
    master: list[int] = field(default_factory=list)  # the fp32 master copy's part of optim (as held)
    dense_optim: list[int] = field(default_factory=list)  # optim's dense and expert parts (as held)
    expert_optim: list[int] = field(default_factory=list)
    trains: bool = False  # has gradients and optimizer states (a LoRA actor's are its adapters')

    def state(self, s: int) -> int:
        return self.params[s] + (self.grads[s] if self.grads else 0) + (self.optim[s] if self.optim else 0)


@dataclass(frozen=True)
class LoraPlan:
    """actor.lora: the adapters' size and, with actor.lora.sync=adapter, what one engine replica receives."""

    projections: list[str]
    total: int  # adapter parameters
    per_gpu_max: int  # on the most loaded GPU
    adapter_sync_bytes: Optional[int]  # None: the engine receives merged weights
    # per pipeline stage, bytes of the adapted weights one rank holds (merged in the merged sync), and the largest
    merged: tuple = ()
    merged_largest: tuple = ()


@dataclass(frozen=True)
class Roles:
    """Every model the run holds, actor first, and the shapes of the work that sizes their activations."""

    models: list[ModelMemory]
    lora: Optional[LoraPlan]
    forward_logits: int  # the logits of one old/ref logprob forward micro-batch, on the last stage
    actor_tokens: int  # per micro-batch and rank (its CP share)
    actor_micro_batches: int  # per mini-batch and rank
    actor_micro_tokens: int = 0  # per micro-batch, before the CP split (0: actor_tokens)
    cp_attention_update: int = 0  # the update's one-layer context-parallel attention transient (0 at CP 1)
    cp_attention_forward: int = 0  # the old/ref log-prob and value forwards' (0 at CP 1 or without a forward)
    moe_dispatch_update: int = 0  # the allgather dispatcher's gathered buffers, one layer of an update micro-batch
    moe_dispatch_forward: int = 0  # the same for the old/ref log-prob and value forwards' micro-batch
    backward_transient: list = field(default_factory=list)  # per stage: one MLP's backward beyond the stored bytes
    optimizer_step: list = field(default_factory=list)  # per stage: the optimizer step's temporaries
    optimizer: str = ""  # which optimizer runs (megarl.plan.terms.OPTIMIZER_*)
    moe_routed: list = field(default_factory=list)  # per stage: the routed experts' part of the actor's activations
    moe_gather_buffer: int = 0  # megatron's global buffer the dispatcher gathers into: kept from the first forward
    token_basis: str = ""  # what the micro-batches' tokens were counted from (token_basis)


@dataclass(frozen=True)
class Lengths:
    """Measured response lengths the plan sizes micro-batches by (None in their place: the worst case, every row at
    prompt_length + response_length tokens). mean_response: the mean response of a batch, in tokens; max_response:
    the longest; source: where they came from, for the plan's text."""

    mean_response: float
    max_response: int
    source: str = ""


@dataclass(frozen=True)
class Batches:
    """An actor mini-batch's sequences on one data-parallel rank: seq_len, the longest row; mean_len, the mean row
    (0: every row at seq_len)."""

    seq_len: int
    per_rank_seqs: int
    mean_len: float = 0

    @property
    def row_len(self) -> float:
        return self.mean_len or self.seq_len

    def micro(self, micro: int, dynamic: bool, max_tokens: int) -> tuple[int, int]:
        """(tokens per micro-batch, micro-batches per mini-batch): fixed-size, or packed to a token budget; never more
        tokens than the rank's mini-batch holds (a budget or micro-batch size above it gives one micro-batch of it)."""
        return micro_tokens(self.per_rank_seqs, self.seq_len, micro, dynamic, max_tokens, self.row_len)


def micro_tokens(seqs: int, seq_len: int, micro: int, dynamic: bool, max_tokens: int,
                 mean_len: Optional[float] = None) -> tuple[int, int]:
    """(tokens per micro-batch, micro-batches) of `seqs` packed rows of mean_len tokens on average (None: seq_len),
    the longest seq_len, split into micro-batches of `micro` rows, or (dynamic) packed to max_tokens tokens (at least
    the longest row each); a micro-batch holds at most all `seqs` rows. A fixed micro-batch is the one holding the
    longest row: (m - 1) x mean_len + seq_len tokens, m = min(micro, seqs); at mean_len = seq_len, m x seq_len."""
    mean = seq_len if mean_len is None else min(mean_len, seq_len)
    whole = max(math.ceil(seqs * mean), seq_len)  # the rank's mini-batch holds its longest row whatever the mean
    if dynamic:
        tokens = min(max(max_tokens, seq_len), whole)
        return tokens, max(1, math.ceil(whole / tokens))
    m = min(micro, seqs)
    return min(math.ceil((m - 1) * mean) + seq_len, whole), max(1, seqs // micro)


def rank_tokens(tokens: int, row_len: float, cp: int) -> int:
    """One CP rank's tokens of a micro-batch of `tokens` tokens in rows of row_len tokens on average (every row at
    full length or the measured mean: ceil(tokens / row_len) rows, each padded), megarl.plan.terms.cp_rank_tokens."""
    return cp_rank_tokens(tokens, math.ceil(tokens / row_len), cp)


def batches(cfg, dp: int, lengths: Optional[Lengths] = None) -> Batches:
    """The actor mini-batch on one DP rank: rows at full length, or (lengths) the prompt at rollout.prompt_length plus
    the measured responses (prompts are not measured: the plan keeps them at their bound)."""
    r = cfg.rollout
    seqs = max(1, cfg.actor.ppo_mini_batch_size * r.n // dp)
    if lengths is None:
        return Batches(r.prompt_length + r.response_length, seqs)
    return Batches(r.prompt_length + lengths.max_response, seqs, r.prompt_length + lengths.mean_response)


MEAN_KEY, MAX_KEY = "train/response_length_mean", "train/response_length_max"


def read_lengths(path: str) -> Lengths:
    """Lengths from a run's metrics (RUN_DIR or its metrics.jsonl, one JSON object per step): the largest per-step
    mean response and the longest response of any step; the largest mean rather than the mean of means because
    responses grow over training and memory must hold the longest-running steps."""
    import json

    f = Path(path)
    if f.is_dir():
        f = f / "metrics.jsonl"
    if not f.is_file():
        raise PlanError(f"--response-lengths {path}: no such file; give a run directory holding metrics.jsonl or the "
                        "file itself, or the lengths with --mean-response-tokens and --max-response-tokens")
    means, longest = [], []
    for n, line in enumerate(f.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise PlanError(f"--response-lengths {f}: line {n} is not JSON ({exc}); metrics.jsonl holds one JSON "
                            "object per step") from None
        if MEAN_KEY in row and MAX_KEY in row:
            means.append(float(row[MEAN_KEY]))
            longest.append(int(row[MAX_KEY]))
    if not means:
        raise PlanError(f"--response-lengths {f}: no step logs both {MEAN_KEY} and {MAX_KEY} (a run logs them from "
                        "its first training step); plan from a run that trained, or give --mean-response-tokens and "
                        "--max-response-tokens")
    return Lengths(max(means), max(longest), f"{f.name}, {len(means)} step(s)")


def check_lengths(lengths: Lengths, response_length: int) -> None:
    """PlanError where the measured lengths cannot describe the recipe's rows."""
    if not 0 < lengths.mean_response <= lengths.max_response:
        raise PlanError(f"response lengths: mean {lengths.mean_response:g}, longest {lengths.max_response}: the rule "
                        "is 0 < mean <= longest; give both in tokens")
    if lengths.max_response > response_length:
        raise PlanError(f"response lengths: the longest, {lengths.max_response} tokens, is over rollout."
                        f"response_length={response_length}, which cuts every response; lower it to at most "
                        f"{response_length} or plan the recipe that produced it")


def token_basis(cfg, lengths: Optional[Lengths]) -> str:
    """The plan text's line on what a micro-batch's tokens were counted from."""
    r = cfg.rollout
    if lengths is None:
        return (f"worst case: every row at full length ({r.prompt_length} prompt + {r.response_length} response "
                "tokens)")
    return (f"measured{' (' + lengths.source + ')' if lengths.source else ''}: mean {lengths.mean_response:g}, longest "
            f"{lengths.max_response} response tokens, prompts at {r.prompt_length}; rows packed")


def activation_bytes_per_token_layer(spec: ArchSpec, tp: int, sp: bool, recompute: str, pbytes: int = 2,
                                     expert_tp: Optional[int] = None, imbalance: float = 1.0,
                                     moe: Optional[bool] = None) -> int:
    """Stored activation bytes of one token in one layer under the recompute setting (see the module doc): the
    formula counts 16-bit elements; activations are in the parameter dtype, so float32 (pbytes 4) doubles it. A MoE
    layer (moe: None = spec.is_moe) has the routed experts at expert TP `expert_tp` (None: TP) with the busiest rank's
    routing `imbalance`, and its shared experts (megarl.plan.terms.moe_routed_units_per_token,
    moe_shared_units_per_token)."""
    h = spec.hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    resid = 8 * h / (tp if sp else 1)
    attn = 4 * q + 4 * kv
    moe = spec.is_moe if moe is None else moe
    if recompute == "selective":
        attn -= 2 * q
    if moe:
        mlp = (moe_routed_units_per_token(spec, tp, sp, expert_tp or tp, imbalance)
               + moe_shared_units_per_token(spec, tp))
        return int((resid + attn / tp + mlp) * pbytes / 2)
    return int((resid + (attn + 6 * spec.ffn_hidden_size) / tp) * pbytes / 2)


def moe_routed_bytes_per_token_layer(spec: ArchSpec, tp: int, sp: bool, pbytes: int, expert_tp: int,
                                     imbalance: float) -> int:
    """The routed experts' part of a MoE layer's stored bytes per token (the text's breakdown)."""
    return int(moe_routed_units_per_token(spec, tp, sp, expert_tp, imbalance) * pbytes / 2)


def stage_layer_bytes(spec: ArchSpec, pl: Placement, sp: bool, recompute: str, imbalance: float,
                      layers: range) -> float:
    """Mean stored bytes per token and layer over a stage's layers (dense and MoE layers each by their own formula)."""
    if not layers:
        return 0.0
    kinds = [is_moe_layer(spec, i) for i in layers]
    per = {m: activation_bytes_per_token_layer(spec, pl.tp, sp, recompute, pl.pbytes, pl.layout.expert_tensor,
                                               imbalance, m) for m in set(kinds)}
    return sum(per[m] for m in kinds) / len(kinds)


def in_flight_layers(pp: int, vpp: int, stage: int, micro_batches: int, layers_per_stage: int) -> float:
    """Layer activations of one micro-batch that pipeline stage `stage` holds at its peak during a training step.

    1F1B (vpp 1): min(PP - stage, micro-batches) micro-batches through all its layers. Interleaved 1F1B (vpp > 1, the
    warm-up count of megatron's get_pp_rank_microbatches plus the one in its forward): (PP - stage - 1) * 2 +
    (VPP - 1) * PP + 1 chunk forwards, at most micro-batches * VPP, each through layers_per_stage / VPP layers. At
    PP2 x VPP2 stage 0 holds 5/4 of a micro-batch's layers where 1F1B holds 2/2: interleaving costs activation memory
    for its smaller bubble."""
    if vpp <= 1:
        return min(pp - stage, micro_batches) * layers_per_stage
    chunks = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp)
    return chunks * layers_per_stage / vpp


def stage_activations(spec: ArchSpec, pl: Placement, sp: bool, recompute: str, tokens: int, micro_batches: int,
                      logits: bool, entropy_bonus: bool = False, imbalance: float = 1.0) -> list[int]:
    """Activation bytes per pipeline stage at the peak of a training step (logits: the LM head's log-prob / entropy
    pass and its backward on the last stage, megarl.plan.terms.update_logits_bytes)."""
    stage_layers = pl.layout.stage_layers(spec.num_layers)  # uneven stages: each stage's own layer count
    out = []
    for s in range(pl.pp):
        mine = range(sum(stage_layers[:s]), sum(stage_layers[:s + 1]))
        layers_in_flight = in_flight_layers(pl.pp, pl.vpp, s, micro_batches, stage_layers[s])
        if recompute == "full":
            per_layer = tokens * (pl.pbytes * spec.hidden_size // (pl.tp if sp else 1))
            extra = int(tokens * max(activation_bytes_per_token_layer(
                spec, pl.tp, sp, "none", pl.pbytes, pl.layout.expert_tensor, imbalance, is_moe_layer(spec, i))
                for i in mine))
        else:
            per_layer = tokens * stage_layer_bytes(spec, pl, sp, recompute, imbalance, mine) + \
                cp_saved_kv(spec, pl, tokens, recompute)
            extra = 0
        last = logits and s == pl.pp - 1
        head = update_logits_bytes(tokens, padded_vocab_size(spec.vocab_size, pl.tp), pl.tp, pl.pbytes,
                                   entropy_bonus) if last else 0
        out.append(int(layers_in_flight * per_layer) + extra + head)
    return out


def cp_saved_kv(spec: ArchSpec, pl: Placement, tokens: int, recompute: str) -> int:
    """Bytes a layer stores for its backward beyond the formula's under context parallelism without Transformer
    Engine: the keys and values gathered over the CP group (CP x this rank's, megarl.plan.terms.attention_kv_bytes)
    that the core attention keeps as its inputs. 0 at CP 1, with TE (its ring buffers are transient,
    cp_attention_bytes) and when the core attention is recomputed (selective or full recompute gathers them again)."""
    if pl.cp == 1 or pl.te or recompute != "none":
        return 0
    return pl.cp * attention_kv_bytes(spec, tokens, pl.tp, pl.pbytes)


def optimizer_bytes_per_param(pbytes: int) -> int:
    return master_bytes_per_param(pbytes) + 8


def master_bytes_per_param(pbytes: int) -> int:
    """The fp32 master copy of a parameter held in 16 bits (none when the parameters are fp32 already)."""
    return 4 if pbytes == 2 else 0


def trainable(name: str, dense: list[int], expert: list[int], pl: Placement, distributed: bool,
              activations: list[int]) -> ModelMemory:
    """A model that trains every parameter: its dense and expert parameter bytes per stage, with their states."""
    opt_bpp = optimizer_bytes_per_param(pl.pbytes)
    n_dense = [b // pl.pbytes for b in dense]
    n_exp = [b // pl.pbytes for b in expert]
    opt_rep = [(a + b) * opt_bpp for a, b in zip(n_dense, n_exp)]
    opt_dist = [a * opt_bpp // pl.dp_cp + b * opt_bpp // pl.edp for a, b in zip(n_dense, n_exp)]
    m_bpp = master_bytes_per_param(pl.pbytes)
    master = ([a * m_bpp // pl.dp_cp + b * m_bpp // pl.edp for a, b in zip(n_dense, n_exp)] if distributed else
              [(a + b) * m_bpp for a, b in zip(n_dense, n_exp)])
    return ModelMemory(name, [a + b for a, b in zip(dense, expert)],
                       grads=[(a + b) * 4 for a, b in zip(n_dense, n_exp)],  # fp32 gradients
                       optim=opt_dist if distributed else opt_rep, optim_distributed=opt_dist,
                       optim_replicated=opt_rep, activations=activations, master=master, trains=True,
                       dense_optim=[a * opt_bpp // (pl.dp_cp if distributed else 1) for a in n_dense],
                       expert_optim=[b * opt_bpp // (pl.edp if distributed else 1) for b in n_exp])


def lora_actor(cfg, pl: Placement, weights: Weights, activations: list[int]) -> tuple[ModelMemory, LoraPlan]:
    """A frozen base (parameters only) and the adapters with their gradients and optimizer states."""
    from megarl.lora.targets import LoraSettings, adapter_numel, resolve_targets, stage_adapter_numel

    lora, p = cfg.actor.lora, cfg.parallelism
    tm = lora.target_modules
    settings = LoraSettings(rank=lora.rank, alpha=lora.alpha, target_modules=tm if isinstance(tm, str) else tuple(tm))
    targets = resolve_targets(weights.sync.mapping, settings)
    n_lora = stage_adapter_numel(targets, lora.rank, pl.tp, pl.pp, pl.ep, p.expert_tensor_parallel_size,
                                 weights.spec.num_layers)
    opt_bpp = optimizer_bytes_per_param(pl.pbytes)
    actor = ModelMemory("actor", [b + n * pl.pbytes for b, n in zip(weights.held, n_lora)],
                        grads=[n * 4 for n in n_lora],
                        optim=[n * opt_bpp // (pl.dp_cp if p.use_distributed_optimizer else 1) for n in n_lora],
                        optim_distributed=[n * opt_bpp // pl.dp_cp for n in n_lora],
                        optim_replicated=[n * opt_bpp for n in n_lora], activations=activations,
                        master=[n * master_bytes_per_param(pl.pbytes) // (pl.dp_cp if p.use_distributed_optimizer
                                                                          else 1) for n in n_lora], trains=True)
    total = adapter_numel(targets, lora.rank)
    adapter = total * DTYPE_BYTES[pl.engine_dtype] if lora.sync == "adapter" else None
    merged, largest = merged_lora_elements(targets, weights.sync.mapping, pl.tp, pl.pp, pl.ep,
                                           p.expert_tensor_parallel_size or pl.tp, weights.spec.num_layers)
    return actor, LoraPlan(sorted({t.projection for t in targets.targets}), total, max(n_lora), adapter,
                           tuple(n * pl.pbytes for n in merged), tuple(n * pl.pbytes for n in largest))


def merged_lora_elements(targets, mapping, tp: int, pp: int, ep: int, etp: int, num_layers: int) -> tuple:
    """([stage 0, ...], [stage 0, ...]): elements of the adapted megatron weights one rank of each pipeline stage
    holds (a weight with any adapted slot is merged whole: its TP share; routed experts, their expert-TP share of
    each, 1/EP of them), and the largest of them. Layers per stage as megarl.lora.targets.stage_adapter_numel."""
    import math

    per_stage = -(-num_layers // pp)
    total, largest = [0] * pp, [0] * pp
    for name, found in targets.by_megatron().items():
        entry = found[0].entry
        n = sum(math.prod(mapping.hf_shape(h)) for h in entry.hf)
        if entry.tp_dim is not None:
            n //= etp if found[0].expert else tp
        s = min(pp - 1, (entry.layer or 0) // per_stage)
        total[s] += n / ep if found[0].expert else n
        largest[s] = max(largest[s], n)
    return [int(math.ceil(t)) for t in total], largest


def critic(pl: Placement, weights: Weights, distributed: bool, activations: list[int]) -> ModelMemory:
    """The actor's shape with the LM head replaced by a 1-wide value head on the last stage."""
    spec = weights.spec
    untied = "lm_head.weight" in weights.sync.mapping.by_hf
    head = (spec.vocab_size * spec.hidden_size // pl.tp * pl.pbytes if untied else 0) - spec.hidden_size * pl.pbytes
    dense = [b - (head if s == pl.pp - 1 else 0) for s, b in enumerate(weights.dense)]
    return trainable("critic", dense, weights.expert, pl, distributed, activations)


def reward_model_spec(cfg, policy: ArchSpec) -> ArchSpec:
    """reward.reward_model's architecture: its config.json, or the policy's when the run has not written it yet."""
    path = Path(cfg.reward.reward_model.path or "") / CONFIG_FILE
    if not (cfg.reward.reward_model.path and path.is_file()):
        return policy
    hf = read_json(path, "reward.reward_model.path")
    try:
        return spec_from_dict(hf.get("text_config", hf), str(path))
    except BridgeError as exc:
        raise PlanError(f"reward.reward_model.path: {exc}") from None


def reward_model_stage_bytes(m: ArchSpec, tp: int, pp: int, ep: int, pbytes: int) -> list[int]:
    """Parameter bytes per pipeline stage of reward.reward_model on one GPU (see the module doc)."""
    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    mlp = 3 * h * m.moe_ffn_hidden_size * m.num_experts // ep if m.is_moe else 3 * h * m.ffn_hidden_size
    layer = (h * (q + 2 * kv) + q * h + mlp) // tp + 2 * h
    per_stage = [layer * (m.num_layers // pp) for _ in range(pp)]
    per_stage[0] += m.vocab_size * h // tp
    per_stage[-1] += h * 2  # final norm and the score head
    return [n * pbytes for n in per_stage]


def policy_forward_runs(cfg) -> bool:
    """Whether the old/ref log-prob phase runs a policy forward: a reference, a teacher, or a step whose update does
    not take the old log-probs from its own forward (megarl.steps.old_log_probs_from_update)."""
    from megarl.steps import old_log_probs_from_update

    warmup = cfg.critic_enabled and cfg.critic.warmup_steps > 0  # steps without an actor update run the old pass
    return bool(cfg.ref_enabled or cfg.distillation.enable or warmup or not old_log_probs_from_update(cfg, True))


def forward_tokens(cfg, seq_len: int, dp: int = 1, cp: int = 1, mean_len: Optional[float] = None) -> int:
    """One rank's tokens of the larger old/ref log-prob forward micro-batch of the forwards that run (its CP share,
    rank_tokens; a token budget is per GPU: CP times it per micro-batch). The old-logprob pass and the critic's values
    take rollout.log_prob_micro_batch_size_per_gpu sequences, the reference (a LoRA actor's too) its own
    ref.log_prob_micro_batch_size_per_gpu (megarl.megatron.workers), a teacher its own. mean_len: the mean row
    (None: every row at seq_len, the longest; micro_tokens)."""
    from megarl.steps import old_log_probs_from_update

    r = cfg.rollout
    warmup = cfg.critic_enabled and cfg.critic.warmup_steps > 0
    policy = cfg.critic_enabled or warmup or not old_log_probs_from_update(cfg, True)
    micros = ([r.log_prob_micro_batch_size_per_gpu] if policy else []) + (
        [cfg.ref.log_prob_micro_batch_size_per_gpu] if cfg.ref_enabled else []) + (
        [cfg.distillation.teacher.log_prob_micro_batch_size_per_gpu] if cfg.distillation.enable else [])
    micro = max(micros, default=r.log_prob_micro_batch_size_per_gpu)
    rows = max(1, cfg.data.train_batch_size * r.n // dp)  # the forwards split the step's batch over DP
    tokens, _ = micro_tokens(rows, seq_len, micro, r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu * cp,
                             mean_len)
    return rank_tokens(tokens, mean_len or seq_len, cp)


def forward_logits(cfg, spec: ArchSpec, tp: int, seq_len: int, pbytes: int, dp: int = 1, cp: int = 1,
                   mean_len: Optional[float] = None) -> int:
    """Logits of the larger old/ref log-prob forward micro-batch on one rank (megarl.plan.terms.forward_logits_bytes);
    0 where the phase runs no policy forward (policy_forward_runs; a critic's values have no vocabulary)."""
    if not policy_forward_runs(cfg):
        return 0
    tokens = forward_tokens(cfg, seq_len, dp, cp, mean_len)
    return forward_logits_bytes(tokens, padded_vocab_size(spec.vocab_size, tp), tp, pbytes)


def cp_attention(spec: ArchSpec, pl: Placement, tokens: int, backward: bool, row_len: int, alike: bool) -> int:
    """The one-layer context-parallel attention transient of a micro-batch of `tokens` tokens on one rank
    (megarl.plan.terms.cp_attention_bytes), and without Transformer Engine its largest blockwise call
    (cp_block_scores_bytes) for rows of row_len tokens, all of that length when `alike` (every row at full length)
    and else the longest alone; 0 at CP 1."""
    kv, out = (attention_kv_bytes(spec, tokens, pl.tp, pl.pbytes), attention_out_bytes(spec, tokens, pl.tp, pl.pbytes))
    scores = 0
    if pl.cp > 1 and not pl.te and tokens:
        rows = max(1, tokens * pl.cp // max(1, row_len)) if alike else 1
        scores = cp_block_scores_bytes(spec.num_attention_heads // pl.tp, row_len, rows, pl.cp)
    return cp_attention_bytes(kv, out, pl.cp, pl.te, backward) + scores


def memory_per_role(cfg, pl: Placement, weights: Weights, lengths: Optional[Lengths] = None) -> Roles:
    """Each model the recipe runs, with its states and activations per pipeline stage; lengths: the measured
    responses the micro-batches are counted from (None: every row at full length)."""
    a, p = cfg.actor, cfg.parallelism
    spec, b = weights.spec, batches(cfg, pl.dp, lengths)

    def micro_batch(micro: int) -> tuple[int, int]:
        """(tokens per micro-batch, micro-batches): a token budget is per GPU, CP times it per micro-batch."""
        return b.micro(micro, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu * pl.cp)

    imbalance = p.moe_routing_imbalance

    def activations(micro: int, logits: bool) -> list[int]:
        tokens, mbs = micro_batch(micro)
        return stage_activations(spec, pl, p.sequence_parallel, cfg.model.recompute,
                                 rank_tokens(tokens, b.row_len, pl.cp), mbs, logits, logits and a.entropy_coeff != 0,
                                 imbalance)

    lora = None
    if a.lora.enabled:
        actor, lora = lora_actor(cfg, pl, weights, activations(a.ppo_micro_batch_size_per_gpu, True))
    else:
        actor = trainable("actor", weights.dense, weights.expert, pl, p.use_distributed_optimizer,
                          activations(a.ppo_micro_batch_size_per_gpu, True))
    models = [actor]
    if cfg.critic_enabled:
        models.append(critic(pl, weights, p.use_distributed_optimizer,
                             activations(cfg.critic.ppo_micro_batch_size_per_gpu, False)))
    if cfg.ref_enabled and not a.lora.enabled:  # a LoRA actor with its adapters off is the reference
        models.append(ModelMemory("ref", list(weights.held)))
    if cfg.reward.reward_model.enable:
        rm = reward_model_spec(cfg, spec)
        models.append(ModelMemory("reward model", reward_model_stage_bytes(rm, pl.tp, pl.pp, pl.ep, pl.pbytes)))
    tokens, mbs = micro_batch(a.ppo_micro_batch_size_per_gpu)
    mine = rank_tokens(tokens, b.row_len, pl.cp)
    update = [mine] + ([rank_tokens(micro_batch(cfg.critic.ppo_micro_batch_size_per_gpu)[0], b.row_len, pl.cp)]
                       if cfg.critic_enabled else [])
    forwards = policy_forward_runs(cfg) or cfg.critic_enabled  # the old/ref log-probs or the critic's values
    fwd_tokens = forward_tokens(cfg, b.seq_len, pl.dp, pl.cp, b.mean_len or None) if forwards else 0
    alike = not b.mean_len  # no measured lengths: every row at full length
    fwd = cp_attention(spec, pl, fwd_tokens, False, b.seq_len, alike) if forwards else 0
    dispatch = [moe_dispatch(spec, pl, p.sequence_parallel, t) for t in (max(update), fwd_tokens)]
    kept = max(moe_gather_buffer(spec, pl, p.sequence_parallel, t) for t in (max(update), fwd_tokens))
    kind = optimizer_kind(cfg, pl)
    trained = [m for m in models if m.trains]
    # a line per stage wherever a model trains (0 for the fused optimizers, named so the plan says which runs)
    steps = [max(optimizer_step_bytes(cfg, spec, pl, kind, m, s) for m in trained) for s in range(pl.pp)] \
        if trained else []
    stage_layers = pl.layout.stage_layers(spec.num_layers)
    backward = [backward_mlp_transient_bytes(spec, max(update), pl.tp, p.sequence_parallel, pl.layout.expert_tensor,
                                             pl.ep, imbalance, pl.pbytes, pl.te, pl.te,
                                             range(sum(stage_layers[:s]), sum(stage_layers[:s + 1])))
                for s in range(pl.pp)]
    # the LM head's logits and their gradients are freed before the backward reaches a layer's MLP
    head = update_logits_bytes(mine, padded_vocab_size(spec.vocab_size, pl.tp), pl.tp, pl.pbytes, a.entropy_coeff != 0)
    backward[-1] = max(0, backward[-1] - head)
    routed = [int(in_flight_layers(pl.pp, pl.vpp, s, mbs, stage_layers[s]) * mine
                  * sum(is_moe_layer(spec, i) for i in range(sum(stage_layers[:s]), sum(stage_layers[:s + 1])))
                  / max(1, stage_layers[s]) * moe_routed_bytes_per_token_layer(
                      spec, pl.tp, p.sequence_parallel, pl.pbytes, pl.layout.expert_tensor, imbalance))
              if spec.is_moe and cfg.model.recompute != "full" else 0 for s in range(pl.pp)]
    logits = forward_logits(cfg, spec, pl.tp, b.seq_len, pl.pbytes, pl.dp, pl.cp, b.mean_len or None)
    return Roles(models, lora, logits, mine, mbs, tokens, cp_attention(spec, pl, max(update), True, b.seq_len, alike), fwd, dispatch[0],
                 dispatch[1], backward, steps, kind, routed, kept, token_basis(cfg, lengths))


def moe_dispatch(spec: ArchSpec, pl: Placement, sp: bool, tokens: int) -> int:
    """The allgather dispatcher's one-layer buffers for a micro-batch of `tokens` tokens on one rank (0 for a dense
    model or a one-rank expert TP x EP group; megarl.plan.terms.moe_dispatcher_bytes)."""
    if not spec.is_moe or not tokens:
        return 0
    etp = pl.layout.expert_tensor
    gathered = moe_gathered_tokens(tokens, pl.tp, sp, etp, pl.ep)
    return moe_dispatcher_bytes(gathered, spec.hidden_size, spec.num_experts, pl.pbytes, etp * pl.ep)


def moe_gather_buffer(spec: ArchSpec, pl: Placement, sp: bool, tokens: int) -> int:
    """megatron's global memory buffer that the allgather dispatcher gathers the hidden states into (use_global_buffer):
    G x h x p for the largest micro-batch, allocated at the first forward and kept by the process (0 for a dense model
    or a one-rank expert TP x EP group)."""
    etp = pl.layout.expert_tensor
    if not spec.is_moe or not tokens or etp * pl.ep <= 1:
        return 0
    return moe_gathered_tokens(tokens, pl.tp, sp, etp, pl.ep) * spec.hidden_size * pl.pbytes


def optimizer_kind(cfg, pl: Placement) -> str:
    """The optimizer megatron will step with (megarl.plan.terms.OPTIMIZER_*): on a CPU trainer torch's AdamW on its
    single-tensor path; on GPU Transformer Engine's FusedAdam where the trainer builds TE layers (TE is installed),
    torch's AdamW on its foreach path where model.use_transformer_engine=false (planned as if apex were absent too:
    the larger of the two)."""
    if cfg.trainer.device == "cpu":
        return OPTIMIZER_SINGLE
    return OPTIMIZER_FUSED if cfg.model.use_transformer_engine is not False else OPTIMIZER_FOREACH


def optimizer_step_bytes(cfg, spec: ArchSpec, pl: Placement, kind: str, m: ModelMemory, s: int) -> int:
    """Model m's optimizer step temporaries on stage s (megarl.plan.terms): foreach, 4 B x the larger of its dense
    and expert main parameters on the rank (sharded as its optimizer states); single-tensor, 2 x 4 B x its largest
    trained tensor; fused, 0."""
    if kind == OPTIMIZER_FUSED:
        return 0
    if kind == OPTIMIZER_SINGLE:
        from megarl.plan.terms import cpu_adam_step_bytes, largest_trained_elements

        lora = cfg.actor.lora.rank if cfg.actor.lora.enabled and m.name == "actor" else 0
        vocab = padded_vocab_size(spec.vocab_size, pl.tp)
        return cpu_adam_step_bytes(largest_trained_elements(spec, s, pl.pp, pl.tp, pl.layout.expert_tensor, vocab,
                                                            m.name == "critic", lora))
    # the optimizer states are 8 B (+ 4 master) per main parameter: their share on the rank gives the elements
    per = optimizer_bytes_per_param(pl.pbytes)
    return foreach_adam_step_bytes(max(m.dense_optim[s], m.expert_optim[s]) // per if m.dense_optim else
                                   m.optim[s] // per)
