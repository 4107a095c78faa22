"""`megarl verify --hf DIR [--lora ADAPTER_DIR] [--tp N --pp N --ep N --cp N] [--tol X]`: logprob parity of megarl's megatron
model with HF.

A reward model (*ForSequenceClassification, num_labels 1) is compared by its scores instead: megarl's value head read
at each sequence's last real token (as reward.reward_model scores samples during RL) against HF
AutoModelForSequenceClassification's logits of each sequence alone (no padding).

Loads the HF checkpoint into megarl at the given layout, computes per-token logprobs of a batch of sequences (text from
the checkpoint's tokenizer, right-padded to different lengths; random ids when there is no tokenizer), computes the same
with HF transformers (float32, eager attention), prints a table per sequence and the max absolute difference over real
tokens, and returns 1 when it exceeds the tolerance. With --lora, a PEFT LoRA adapter directory is loaded onto the base
on both sides: megarl's adapters on its megatron linears, and `peft.PeftModel.from_pretrained` on the HF model.

Precision. float32 is compared in float32: TF32 is off in every rank (megarl.megatron.precision, NVIDIA_TF32_OVERRIDE=0
included, which Transformer Engine's GEMMs obey), and the tolerance on the max difference is derived from the model
(megarl.numerics.fp32_logprob_bound: its widths, depth, vocabulary, the batch's positions and the reference logits'
RMS), so a right mapping passes at any width (1.4e-4 for the tiny llama, 3e-4 at Qwen2.5-0.5B's widths with 2 layers)
while a wrong one misses it by orders of magnitude. In bfloat16 the
statistic is the mean absolute difference over real tokens and the tolerance is derived from the reference's logits:
    tol = BF16_TOLERANCE_UNITS * 2**-8 * scale,  scale = RMS over real positions of the fp32 logits' std over the vocab
(a relative error of c * u on the logits moves a logprob by about c * u * scale; bf16's unit roundoff is u = 2**-8).
On the seven tiny architectures a correct bridge measures 2.3 to 4.7 units on CPU, while a wrong mapping measures 9 (one
layer's norm weight reversed) to 250 (rope's interleaved vs half layout in one layer's q_proj); the max difference
cannot tell them apart (MoE routing flips at near-ties give a correct mixtral a 0.38 max). When a difference is over
the tolerance but has the size of a precision effect (TF32 or bf16 rounding), verify says so instead of blaming the
bridge.

Ranks. As a plain command (no WORLD_SIZE in the environment) it starts the ranks itself with
megarl.launch_local.run_ranks: world size = TP * PP * EP, i.e. data parallel size = EP (megatron's expert-parallel group
is carved out of the TP * DP ranks of a stage, with expert TP = TP); with --cp, TP * PP * lcm(CP, EP) (each row split
over the CP ranks; experts over the CP x DP ranks). Under torchrun it uses the ranks it is given
(the world size must be a multiple of TP * PP, with DP divisible by EP); every DP replica computes the same batch and
global rank 0 prints.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional, Sequence

import torch

from megarl.hf_reference import hf_logprobs, hf_scores, real_mask
from megarl.numerics import fp32_bound

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from verifiable rewards trains a policy.",
    "Question: what is 12 * 7? Let us think step by step. 12 * 7 = 84, so the answer is 84.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Megatron shards the weights over tensor, pipeline and expert parallel ranks; vLLM generates rollouts.",
]


def world_size_for(tp: int, pp: int, ep: int, engine_tp: int = 1, cp: int = 1) -> int:
    """Ranks a plain `megarl verify` starts: TP * PP * lcm(CP, EP) (experts spread over the CP x DP ranks, data
    parallel = EP / CP when EP is larger), or more when the engine's TP needs more ranks to host its workers (the
    extra ranks are data-parallel replicas)."""
    step = tp * pp * math.lcm(cp, ep)
    world = step
    while world < engine_tp:
        world += step
    return world


def _positive(text: str) -> int:
    """argparse type of a parallel size: an integer >= 1 (argparse turns the error into a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a parallel size is an integer >= 1, got {text!r}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--lora", default=None, help="PEFT LoRA adapter directory (adapter_config.json + "
                   "adapter_model.safetensors) to load onto the base on both sides")
    p.add_argument("--tp", type=_positive, default=1, help="tensor_model_parallel_size")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline_model_parallel_size")
    p.add_argument("--ep", type=_positive, default=1, help="expert_model_parallel_size (MoE)")
    p.add_argument("--cp", type=_positive, default=1, help="context_parallel_size: each sequence split over CP ranks "
                   "(2*CP load-balanced chunks per row, attention over the whole row)")
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="uneven pipeline stages: num_layers_in_first_pipeline_stage")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="uneven pipeline stages: num_layers_in_last_pipeline_stage")
    p.add_argument("--tol", type=float, default=None,
                   help="max abs logprob difference allowed (default in float32: derived from the model's widths, "
                   "depth, vocabulary and logits); in bfloat16 the default judges the mean abs difference against a "
                   "tolerance derived from the logits' scale (see the module docstring)")
    p.add_argument("--batch", type=int, default=4, help="number of sequences")
    p.add_argument("--seq-len", type=int, default=64, help="padded sequence length")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch size of the megatron forward")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (no tokenizer) and model init")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="megatron parameter dtype")
    p.add_argument("--engine", choices=["megatron", "vllm", "hf"], default="megatron",
                   help="megatron: compare megarl's logprobs with HF transformers; vllm: also push megarl's weights "
                   "into a vLLM engine started with random weights and compare vLLM's logprobs with megarl's; hf: "
                   "the same with the transformers rollout engine (rollout.name=hf; engine TP1, merged weights)")
    p.add_argument("--engine-tp", type=_positive, default=1, help="with --engine vllm: the engine's tensor parallel size "
                   "(its workers are hosted by trainer ranks 0..engine_tp-1 and each receives only its shard)")
    p.add_argument("--engine-ep", type=_positive, default=1, help="with --engine vllm: the engine's expert parallel size "
                   "(1, or equal to --engine-tp)")
    p.add_argument("--lora-sync", choices=["merged", "adapter"], default="merged",
                   help="with --engine vllm and --lora: merged pushes base + alpha/rank * B A into the engine; adapter "
                   "starts the engine with vLLM's LoRA support and loads only the adapters (actor.lora.sync)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the started ranks are killed")
    args = p.parse_args(argv)
    args.derived_tol = args.tol is None
    return args


BF16_UNIT = 2.0 ** -8  # bf16: 8 significant bits
TF32_UNIT = 2.0 ** -11  # TF32: 11 significant bits
BF16_TOLERANCE_UNITS = 8.0  # a correct bridge: <= 4.7; a wrong mapping: >= 9 (module docstring)


def precision_tolerance(dtype_unit: float, scale: float, units: float = BF16_TOLERANCE_UNITS) -> float:
    """The mean abs logprob difference that rounding with unit roundoff `dtype_unit` explains, for logits of `scale`."""
    return units * dtype_unit * scale


def _cpu_reduced_precision() -> str:
    """Which reduced-precision fp32 math is switched on in this process on the CPU, if any (oneDNN's bf16 / TF32 modes
    for fp32 matmuls and convolutions, or its fpmath environment variable)."""
    found = []
    mode = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE")
    if mode and mode.lower() not in ("strict", "any"):
        found.append(f"ONEDNN_DEFAULT_FPMATH_MODE={mode}")
    backend = getattr(torch.backends, "mkldnn", None)
    for name in ("matmul", "conv"):
        precision = getattr(getattr(backend, name, None), "fp32_precision", None)
        if precision not in (None, "ieee", "none"):
            found.append(f"torch.backends.mkldnn.{name}.fp32_precision={precision!r}")
    return ", ".join(found)


def diagnose(max_diff: float, mean_diff: float, scale: float, dtype: str, tf32: bool, device: str = "cpu") -> str:
    """Why a comparison failed: a precision effect (named, with what to do, among the causes possible on `device`) or
    a mapping the bridge gets wrong."""
    if dtype == "float32" and mean_diff <= precision_tolerance(BF16_UNIT, scale):
        kind = "TF32" if mean_diff <= precision_tolerance(TF32_UNIT, scale) else "bf16"
        if device == "cuda":
            where = ("TF32 was in effect in this process (set NVIDIA_TF32_OVERRIDE=0 before CUDA starts, or "
                     "model.allow_tf32=false)" if tf32 else
                     "some operation ran in reduced precision although TF32 is off here (a library that ignores "
                     "NVIDIA_TF32_OVERRIDE, or a bf16 kernel)")
        else:
            switched = _cpu_reduced_precision()
            where = (f"reduced-precision fp32 math is switched on here ({switched}); switch it off" if switched else
                     "on the CPU some kernel computed in reduced precision (a bf16 / AMX kernel given float32 "
                     "inputs: e.g. an engine backend that casts, or oneDNN's fpmath mode), or the checkpoint's "
                     "weights were rounded to bf16 on one side only")
        return (f"the difference (mean {mean_diff:.2e}, max {max_diff:.2e}) has the size of {kind} rounding of "
                f"logits of scale {scale:.3g}, not of a mapping error: {where}")
    return ("the checkpoint may use a feature the bridge maps incorrectly (the difference is larger than the "
            f"{dtype} precision explains for logits of scale {scale:.3g}; report it with this output)")


def make_batch(hf_dir: str, vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> tuple:
    """(tokens [batch, seq_len] right-padded, lengths [batch], source) from the tokenizer, else random ids."""
    lengths = torch.tensor([max(2, seq_len - i * seq_len // (2 * batch)) for i in range(batch)])
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        tokens.fill_(pad)
        for i in range(batch):
            ids: list = []
            j = i
            while len(ids) < lengths[i]:
                more = tok(TEXTS[j % len(TEXTS)] + " ", add_special_tokens=False)["input_ids"]
                if not more:  # a tokenizer without a vocabulary (none saved with the model) encodes nothing
                    raise ValueError("the tokenizer encodes the sample text as no tokens")
                ids += more
                j += 1
            tokens[i, : lengths[i]] = torch.tensor(ids[: lengths[i]])
        if int(tokens.max()) >= vocab_size:
            raise ValueError(f"the tokenizer produces id {int(tokens.max())} >= vocab_size={vocab_size}")
        return tokens, lengths, "tokenizer"
    except Exception as exc:  # no or unusable tokenizer: random ids still verify the weights
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
        for i in range(batch):
            tokens[i, lengths[i]:] = 0
        return tokens, lengths, f"random ids ({type(exc).__name__}: {exc})"


def megatron_logprobs(hf_dir: str, tokens: torch.Tensor, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                      micro_batch: int = 1, dtype: str = "float32", seed: int = 0, engine: str = "megatron",
                      lengths: Optional[torch.Tensor] = None, engine_tp: int = 1, engine_ep: int = 1,
                      lora: Optional[str] = None, reward_model: bool = False, first_stage: Optional[int] = None,
                      last_stage: Optional[int] = None, lora_sync: str = "merged") -> dict:
    """Rank body (after init_distributed): {"megatron": megarl's logprobs [B, S-1] (reward_model: scores [B] at the
    last real token of each row) on the rank that reports them (last pipeline stage, TP rank 0, DP rank 0), else
    None}; cp: context-parallel size; with engine="vllm", rank 0 adds "vllm" (per-sequence logprob lists of the real
    tokens) and "sync" (weight-sync metrics). lora: a PEFT adapter directory loaded onto megarl's linears; first_stage / last_stage:
    layers of the first / last pipeline stage (uneven stages); lora_sync: "adapter" loads the adapters into vLLM's
    LoRA support instead of merged weights (megarl.sync.transports.adapter)."""
    from megatron.core import parallel_state as ps

    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.precision import apply_precision, tf32_in_effect

    apply_precision(allow_tf32=False)  # float32 means float32 (the parent set the libraries' override already)
    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, context_parallel_size=cp,
                               num_layers_in_first_pipeline_stage=first_stage,
                               num_layers_in_last_pipeline_stage=last_stage), seed=seed)
    model, spec = build_and_load(hf_dir, dtype=getattr(torch, dtype), value_head=reward_model)
    engine_lora = None
    if lora:
        from megarl.lora.layers import apply_lora, load_adapters
        from megarl.lora.peft_io import read_adapter, settings_from_peft
        from megarl.lora.vllm import lora_engine_settings

        settings = settings_from_peft(lora)
        targets = apply_lora(model, spec, settings)
        load_adapters(model, read_adapter(lora))
        if lora_sync == "adapter":
            engine_lora = lora_engine_settings(settings, [t.projection for t in targets.targets])
    model.eval()
    if reward_model:
        from megarl.megatron.forward import token_values
        from megarl.reward.model import last_token_scores

        values = token_values(model, tokens, micro_batch_size=micro_batch, lengths=lengths)
        out = None if values is None else last_token_scores(values, lengths)
    else:
        # the rows' real lengths: micro-batches run packed as in training (nothing computed past a row's length)
        out = token_logprobs(model, tokens, micro_batch_size=micro_batch, lengths=lengths)
    report = (out is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
              and ps.get_context_parallel_rank() == 0)
    result = {"megatron": out.cpu() if report else None, "tf32": tf32_in_effect(),
              "device": "cuda" if torch.cuda.is_available() else "cpu"}
    if engine in ("vllm", "hf"):
        result.update(_engine_logprobs(model, spec, hf_dir, tokens, lengths, dtype, engine_tp, engine_ep,
                                       engine_lora, name=engine))
    return result


def _engine_logprobs(model, spec, hf_dir: str, tokens: torch.Tensor, lengths: torch.Tensor, dtype: str,
                     engine_tp: int = 1, engine_ep: int = 1, lora: Optional[dict] = None,
                     name: str = "vllm") -> dict:
    """Rank 0 starts a vLLM engine (TP engine_tp, EP engine_ep) with random (dummy) weights; every rank delivers
    megarl's weights into it through the trainer's weight sync (each engine worker receives its own shard from the
    ranks that hold it; checksums verified on every worker); rank 0 returns vLLM's logprobs of the batch.
    lora (megarl.lora.vllm.lora_engine_settings): the engine starts with vLLM's LoRA support and the adapter sync
    runs as the trainer's does with dummy weights: the base through the ordinary sync, then the adapters alone.
    name: the engine (rollout.name: vllm, or hf for the transformers engine)."""
    import torch.distributed as dist

    from megarl.config.schema import RolloutConfig
    from megarl.sync.factory import SyncFactory
    from megarl.rollout.hosting.process import EngineProcess, EngineProcessError
    from megarl.layout import EngineTopology

    engine, failed = None, [None]
    if dist.get_rank() == 0:
        cfg = RolloutConfig(name=name, prompt_length=tokens.shape[1], response_length=1, load_format="dummy",
                            dtype=dtype,
                            enable_prefix_caching=False, tensor_model_parallel_size=engine_tp,
                            expert_model_parallel_size=engine_ep)
        try:
            engine = EngineProcess(cfg, hf_dir, seed=0, lora=lora, name=f"megarl-{name}-engine")
        except EngineProcessError as exc:  # one line: the cause, the fix where known, the engine's log
            failed[0] = str(exc)
    from megarl.distributed import broadcast_object

    failed = broadcast_object(failed, src=0)  # no rank waits on a sync into an engine that is not there
    if failed[0] is not None:
        return {"engine_error": failed[0]} if dist.get_rank() == 0 else {}
    try:
        topology = EngineTopology(dist.get_world_size(), engine_tp, 1)
        factory = SyncFactory(model, spec)
        full = factory.colocated(engine, topology, 64 << 20) if lora is None else \
            factory.adapters(engine, topology, 64 << 20, getattr(torch, dtype), base_weights=True)
        sync = full.run(engine, verify=True)
        if engine is None:
            return {}
        seqs = [tokens[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        return {"vllm": engine.sequence_logprobs(seqs), "sync": sync}
    finally:
        if engine is not None:
            engine.shutdown()


def compare_scores(reference: torch.Tensor, got: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """(max abs score difference, [(seq, n_tokens, diff, reference score)])."""
    rows = [(i, n, abs(float(got[i]) - float(reference[i])), float(reference[i]))
            for i, n in enumerate(lengths.tolist())]
    return max(r[2] for r in rows), rows


def compare(reference: torch.Tensor, got: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """(max abs diff over real tokens, [(seq, n_tokens, max diff, mean ref logprob)]) ."""
    rows = []
    for i, n in enumerate(lengths.tolist()):
        d = (got[i, : n - 1].float() - reference[i, : n - 1]).abs()
        rows.append((i, n, d.max().item() if n > 1 else 0.0, reference[i, : n - 1].mean().item()))
    return max(r[2] for r in rows), rows


def mean_abs_diff(reference: torch.Tensor, got: torch.Tensor, lengths: torch.Tensor) -> float:
    mask = real_mask(lengths, reference.shape[1])
    return float((got.float() - reference.float()).abs()[mask].mean())


def report(args, rows, max_diff, source, out=None, reference: str = "HF", other: str = "megarl",
           mean_diff: float = 0.0, scale: float = 1.0, tf32: bool = False, quantity: str = "logprob",
           fp32_tol: Optional[float] = None, device: str = "cpu") -> int:
    """Print the table and the verdict; `fp32_tol` is the derived float32 tolerance (fp32_bound), used when no --tol
    was given."""
    out = out or sys.stdout
    engine = args.engine
    if engine in ("vllm", "hf"):
        engine = f"{engine} (TP{args.engine_tp} EP{args.engine_ep})"
    lora = f" + LoRA {args.lora}" if getattr(args, "lora", None) else ""
    first, last = getattr(args, "first_stage_layers", None), getattr(args, "last_stage_layers", None)
    stages = "" if first is None and last is None else f" (stages first={first} last={last})"
    cp = getattr(args, "cp", 1)
    print(f"megarl verify {args.hf}{lora}  TP={args.tp} PP={args.pp}{stages} EP={args.ep}"
          f"{f' CP={cp}' if cp > 1 else ''} dtype={args.dtype} "
          f"engine={engine}  batch from {source}; TF32 {'on' if tf32 else 'off'}", file=out)
    head = f"{reference} score" if quantity == "score" else f"mean {reference} logprob"
    print(f"{'seq':>4} {'tokens':>6} {'max|diff|':>11} {head:>16}", file=out)
    for i, n, d, mean in rows:
        print(f"{i:>4} {n:>6} {d:>11.3e} {mean:>16.4f}", file=out)
    derived = getattr(args, "derived_tol", False)
    if derived and args.dtype != "float32" and quantity == "logprob":
        tol = precision_tolerance(BF16_UNIT, scale)
        ok = mean_diff <= tol
        print(f"max abs logprob difference {max_diff:.3e}; mean abs logprob difference {mean_diff:.3e} ({other} vs "
              f"{reference}, tolerance {tol:.2e} = {BF16_TOLERANCE_UNITS:g} x bf16 unit roundoff x logits scale "
              f"{scale:.3g}): {'OK' if ok else 'FAILED'}", file=out)
        bound = f"the derived tolerance {tol:.2e}"
        stat = mean_diff
    else:
        if not derived:
            tol, how = args.tol, "--tol"
        elif args.dtype == "float32":
            tol, how = fp32_tol, "derived from the model's widths, depth and logits in float32"
        else:  # bf16 scores: a relative error of the same units of bf16 roundoff as logprobs get, on the scores' RMS
            tol, how = precision_tolerance(BF16_UNIT, scale), f"{BF16_TOLERANCE_UNITS:g} x bf16 unit x score RMS"
        ok = max_diff <= tol
        if derived:
            how += f"; margin {tol / max(max_diff, 1e-30):.3g}x"
        print(f"max abs {quantity} difference {max_diff:.3e} ({other} vs {reference}, tolerance {tol:.2e}, {how}): "
              f"{'OK' if ok else 'FAILED'}" + (f"; mean {mean_diff:.3e}" if quantity == "logprob" else ""), file=out)
        bound = f"the derived tolerance {tol:.2e}" if derived else f"--tol {tol:.1e}"
        stat = max_diff
    if not ok:
        print(f"error: {other}'s {quantity}s differ from {reference}'s by {stat:.3e} > {bound}; "
              + diagnose(max_diff, mean_diff, scale, args.dtype, tf32, device), file=out)
    return 0 if ok else 1


def _rank_body(**kwargs):
    return megatron_logprobs(**kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megarl.bridge.hf_config import BridgeError, check_layout, check_weight_files, load_spec

    args = parse_args(argv)
    try:
        spec = load_spec(args.hf)
        if spec.vision is not None:  # text around images: megarl.verify_vl
            check_layout(spec, args.tp, args.pp, 1, first_stage=args.first_stage_layers,
                         last_stage=args.last_stage_layers)
            return _main_vl(args, spec)
        if spec.score_head and args.engine in ("vllm", "hf"):
            raise BridgeError(f"{args.hf}: {spec.architecture} is a reward model; --engine {args.engine} compares "
                              "the logprobs of causal LMs (leave --engine at megatron to compare its scores with HF)")
        if args.engine == "hf" and (args.engine_tp, args.engine_ep, args.lora_sync) != (1, 1, "merged"):
            raise BridgeError(f"--engine hf with --engine-tp {args.engine_tp} --engine-ep {args.engine_ep} "
                              f"--lora-sync {args.lora_sync}: the hf engine runs one worker with merged weights; "
                              "leave them at 1, 1 and merged, or use --engine vllm")
        check_layout(spec, args.tp, args.pp, args.ep, first_stage=args.first_stage_layers,
                     last_stage=args.last_stage_layers)
        if args.lora:  # read only inside the ranks: refuse a missing or damaged adapter here, in one line
            if not os.path.isfile(os.path.join(args.lora, "adapter_config.json")):
                raise BridgeError(f"--lora {args.lora}: no adapter_config.json there (a PEFT LoRA adapter directory "
                                  "holds adapter_config.json and adapter_model.safetensors); fix the path")
            check_weight_files(args.lora)
    except BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from megarl.megatron.precision import apply_precision

    apply_precision(allow_tf32=False)  # before any rank starts CUDA: the ranks inherit NVIDIA_TF32_OVERRIDE=0
    tokens, lengths, source = make_batch(args.hf, spec.vocab_size, args.batch, args.seq_len, args.seed)
    kwargs = dict(hf_dir=str(args.hf), tokens=tokens, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp,
                  micro_batch=args.micro_batch, dtype=args.dtype, seed=args.seed, engine=args.engine, lengths=lengths,
                  engine_tp=args.engine_tp, engine_ep=args.engine_ep, lora=args.lora, reward_model=spec.score_head,
                  first_stage=args.first_stage_layers, last_stage=args.last_stage_layers,
                  lora_sync=args.lora_sync if args.lora else "merged")
    args.reward_model = spec.score_head
    if "WORLD_SIZE" in os.environ:  # under torchrun: use the ranks we were given
        import torch.distributed as dist

        from megarl.distributed import init_distributed
        from megarl.distributed import all_gather_objects, broadcast_object

        init_distributed()
        # the results and the verdict are host objects: over gloo beside an NCCL default group
        gathered = all_gather_objects(megatron_logprobs(**kwargs))
        return broadcast_object(_judge(args, gathered, tokens, lengths, source) if dist.get_rank() == 0 else None)
    from megarl.launch_local import RankFailure, run_ranks

    world = world_size_for(args.tp, args.pp, args.ep, args.engine_tp if args.engine in ("vllm", "hf") else 1,
                           args.cp)
    try:
        results = run_ranks("megarl.verify:_rank_body", world, kwargs, timeout=args.timeout)
    except RankFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _judge(args, results, tokens, lengths, source)


def _main_vl(args, spec) -> int:
    """verify on a vision-language spec (megarl.verify_vl: the images and the rank body): the exit code."""
    from megarl.bridge.hf_config import BridgeError
    from megarl.hf_reference import hf_vl_logprobs
    from megarl.launch_local import RankFailure, run_ranks
    from megarl.verify_vl import make_vl_batch

    unsupported = [(flag, value) for flag, value, default in (
        ("--engine", args.engine, "megatron"), ("--lora", args.lora, None), ("--ep", args.ep, 1),
        ("--cp", args.cp, 1), ("--dtype", args.dtype, "float32"), ("--micro-batch", args.micro_batch, 1))
        if value != default]
    if unsupported or "WORLD_SIZE" in os.environ:
        what = ", ".join(f"{f} {v}" for f, v in unsupported) or "torchrun"
        print(f"error: {args.hf}: {spec.architecture} is verified in float32 against HF transformers at any --tp / "
              f"--pp, started as a plain command; not yet with {what}", file=sys.stderr)
        return 2
    try:
        batch = make_vl_batch(args.hf, spec, TEXTS, args.batch, args.seq_len, args.seed)
    except BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = batch["tokens"]
    kwargs = dict(hf_dir=str(args.hf), batch=batch, tp=args.tp, pp=args.pp, seed=args.seed,
                  first_stage=args.first_stage_layers, last_stage=args.last_stage_layers)
    try:
        results = run_ranks("megarl.verify_vl:rank_body", args.tp * args.pp, kwargs, timeout=args.timeout)
    except RankFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    got = next(r["megatron"] for r in results if r["megatron"] is not None)
    grid = batch["image_grid_thw"]
    hf, stats = hf_vl_logprobs(args.hf, tokens, batch["pixel_values"], grid, spec.vision.image_token_id)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1])
    tol = fp32_bound(spec, tokens.shape[1], hf.numel(), stats.rms, vision_segment=int(grid[:, 1:].prod(-1).max()))
    max_diff, rows = compare(hf, got, lengths)
    m = spec.vision.spatial_merge_size
    grids = [[t, h // m, w // m] for t, h, w in grid.tolist()]
    source = f"the tokenizer and {tokens.shape[0]} synthetic images (merged grids {grids})"
    return report(args, rows, max_diff, source, mean_diff=mean_abs_diff(hf, got, lengths), scale=stats.scale,
                  fp32_tol=tol)


def _judge(args, results: list, tokens: torch.Tensor, lengths: torch.Tensor, source: str) -> int:
    """Compare megatron with HF (engine=megatron) or vLLM with megatron (engine=vllm); print the table; exit code."""
    engine_error = next((r["engine_error"] for r in results if r.get("engine_error")), None)
    if engine_error is not None:  # the engine did not start: its cause in one line
        print(f"error: {engine_error}", file=sys.stderr)
        return 2
    from megarl.bridge.hf_config import load_spec

    got = next(r["megatron"] for r in results if r.get("megatron") is not None)
    tf32 = any(r.get("tf32") for r in results)
    device = "cuda" if any(r.get("device") == "cuda" for r in results) else "cpu"
    spec, seq_len = load_spec(args.hf), tokens.shape[1]
    if getattr(args, "reward_model", False):
        reference = hf_scores(args.hf, tokens, lengths)
        max_diff, rows = compare_scores(reference, got, lengths)
        tol = fp32_bound(spec, seq_len, len(rows), float(reference.float().pow(2).mean().sqrt()), score=True)
        return report(args, rows, max_diff, source, quantity="score", tf32=tf32, fp32_tol=tol, device=device,
                      scale=float(reference.float().pow(2).mean().sqrt()))
    hf, stats = hf_logprobs(args.hf, tokens, lengths, getattr(args, "lora", None))
    positions = int(real_mask(lengths, hf.shape[1]).sum())
    tol = fp32_bound(spec, seq_len, positions, stats.rms)
    if args.engine == "megatron":
        max_diff, rows = compare(hf, got, lengths)
        return report(args, rows, max_diff, source, reference="HF+PEFT" if getattr(args, "lora", None) else "HF",
                      mean_diff=mean_abs_diff(hf, got, lengths), scale=stats.scale, tf32=tf32, fp32_tol=tol,
                      device=device)
    engine = next(r for r in results if "vllm" in r)
    vllm = torch.zeros_like(got)
    for i, row in enumerate(engine["vllm"]):
        vllm[i, : len(row)] = torch.tensor(row)
    hf_diff, _ = compare(hf, got, lengths)
    sync = engine["sync"]
    label = "vLLM" if args.engine == "vllm" else "the hf engine"
    print(f"weight sync into {label} (engine TP{args.engine_tp} EP{args.engine_ep}): "
          f"{sync['weight_sync/num_tensors']:.0f} tensors, {sync['weight_sync/bytes'] / 2**20:.1f} MiB in "
          f"{sync['weight_sync/seconds']:.2f} s, {sync['weight_sync/verified_tensors']:.0f} engine tensors' checksums "
          f"verified; "
          f"megarl vs HF transformers: {hf_diff:.3e}")
    if "sync/bytes" in sync:  # --lora-sync adapter: the base once, then the adapters into vLLM's LoRA support
        print(f"adapter sync into vLLM's LoRA support: {sync['weight_sync/num_tensors']:.0f} adapter tensors, "
              f"{sync['sync/bytes']:.0f} bytes in {sync['weight_sync/adapter_install_seconds']:.3f} s")
    max_diff, rows = compare(got, vllm, lengths)  # reference: megarl's own logprobs
    return report(args, rows, max_diff, source, reference="megarl", other=label if args.engine == "vllm" else "hf",
                  mean_diff=mean_abs_diff(got, vllm, lengths), scale=stats.scale, tf32=tf32, fp32_tol=tol,
                  device=device)


if __name__ == "__main__":
    sys.exit(main())
