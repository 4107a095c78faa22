"""HF -> megarl (any TP/PP/EP layout) -> logprobs equal HF transformers' within the float32 bound derived from each
model's widths, depth, vocabulary and logits (tests/helpers/bounds.py: rounding only, on any kernel set), and
HF -> megarl -> export is bitwise the input checkpoint (every name, no extra names).

One launch per layout covers every architecture that layout applies to (start-up dominates on 2 cores):
  tp1, tp2, pp2, tp2pp2 (4 ranks): all 7 architectures; ep2, tp2ep2 (4 ranks): the 3 MoE architectures.
Round trips are checked at tp2pp2 (all) and ep2 (MoE). The measured differences are printed (pytest -s).
"""
import pytest

from megarl.launch_local import run_ranks
from tests.helpers.bounds import logprob_bound
from tests.helpers.tiny_models import (ARCHS, DENSE_ARCHS, MOE_ARCHS, hf_logprobs, make_tiny_model, read_checkpoint,
                                      sample_tokens)

pytestmark = pytest.mark.parity
SEQ, N, MICRO = 24, 4, 2

# (id, tp, pp, ep, architectures, check export round trip)
REPEAT = pytest.mark.parity_repeat  # the AVX2 tier keeps tp2, pp2 and ep2: every kernel these layouts run
LAYOUTS = [
    pytest.param("tp1", 1, 1, 1, ARCHS, False, marks=REPEAT, id="tp1"),
    pytest.param("tp2", 2, 1, 1, ARCHS, False, id="tp2"),
    pytest.param("pp2", 1, 2, 1, ARCHS, False, id="pp2"),
    pytest.param("tp2pp2", 2, 2, 1, ARCHS, True, marks=REPEAT, id="tp2pp2"),
    pytest.param("ep2", 1, 1, 2, MOE_ARCHS, True, id="ep2"),
    pytest.param("tp2ep2", 2, 1, 2, MOE_ARCHS, False, marks=REPEAT, id="tp2ep2"),
]
SLOW_LAYOUTS = [
    # beyond the acceptance matrix: round trips at the remaining layouts, PP2 x EP2 and sequence-parallel dense TP2
    ("tp2_sp", 2, 1, 1, DENSE_ARCHS, True),
    ("pp2ep2", 1, 2, 2, MOE_ARCHS, True),
    ("tp2ep2_export", 2, 1, 2, MOE_ARCHS, True),
]


def round_trip_problems(exported: dict, hf_dir: str) -> list:
    import torch

    ref = read_checkpoint(hf_dir)
    exported = {n: t.cpu() for n, t in exported.items()}
    problems = [f"missing {n}" for n in ref if n not in exported]
    problems += [f"extra {n}" for n in exported if n not in ref]
    problems += [f"differs {n}" for n in ref if n in exported and (exported[n].dtype != ref[n].dtype
                                                                   or not torch.equal(exported[n], ref[n]))]
    return problems


def parity_rank(models: dict, tokens, tp: int, pp: int, ep: int, export: bool, sequence_parallel=None,
                use_te=None):
    """Load each model at the layout; return {arch: (logprobs or None, round-trip problems or None)}."""
    import torch

    from megarl.bridge import export_to_dict
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep), seed=123)
    out = {}
    for arch, hf_dir in models.items():
        model, spec = build_and_load(hf_dir, sequence_parallel=sequence_parallel, use_te=use_te,
                                     dtype=torch.float32)
        model.eval()
        logprobs = token_logprobs(model, tokens, micro_batch_size=MICRO)
        problems = round_trip_problems(export_to_dict(model, spec, bucket_bytes=64 << 10), hf_dir) if export else None
        out[arch] = (logprobs, problems)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """All tiny models, a right-padded batch, the HF reference logprobs of each model and their derived bounds."""
    root = tmp_path_factory.mktemp("tiny_models")
    tokens, lengths = sample_tokens(N, SEQ, seed=3)
    mask = _real(lengths)
    models, refs = {}, {}
    for arch in ARCHS:
        models[arch] = str(make_tiny_model(arch, root / arch, seed=ARCHS.index(arch)))
        refs[arch] = (hf_logprobs(models[arch], tokens), logprob_bound(models[arch], tokens, mask))
    return models, refs, tokens, lengths


def _real(lengths):
    import torch

    return torch.arange(SEQ - 1)[None, :] < (lengths[:, None] - 1)


def _check(tiny, tp, pp, ep, archs, export, name, sequence_parallel=None, use_te=None):
    models, refs, tokens, lengths = tiny
    results = run_ranks(f"{__name__}:parity_rank", tp * pp * ep,
                        {"models": {a: models[a] for a in archs}, "tokens": tokens, "tp": tp, "pp": pp, "ep": ep,
                         "export": export, "sequence_parallel": sequence_parallel, "use_te": use_te}, timeout=600)
    mask = _real(lengths)
    for arch in archs:
        ref, tol = refs[arch]
        reporting = [r[arch][0].cpu() for r in results if r[arch][0] is not None]
        assert len(reporting) == tp * ep, f"{arch}: {len(reporting)} ranks reported logprobs"  # the last stage
        worst = max(((lp - ref).abs() * mask).max().item() for lp in reporting)
        print(f"[{name}] {arch}: max |logprob diff| = {worst:.2e} (bound {tol:.2e})")
        assert worst < tol, f"{arch} at {name}: max abs logprob diff {worst:.3e} >= derived bound {tol:.3e}"
        if export:
            for rank, r in enumerate(results):
                assert r[arch][1] == [], f"{arch} at {name}, rank {rank}: round trip problems {r[arch][1][:10]}"


@pytest.mark.parametrize("name,tp,pp,ep,archs,export", LAYOUTS)
def test_logprob_parity(tiny, name, tp, pp, ep, archs, export):
    _check(tiny, tp, pp, ep, archs, export, name)


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,pp,ep,archs,export", SLOW_LAYOUTS, ids=[lay[0] for lay in SLOW_LAYOUTS])
def test_logprob_parity_more_layouts(tiny, name, tp, pp, ep, archs, export):
    _check(tiny, tp, pp, ep, archs, export, name, sequence_parallel=True if name == "tp2_sp" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_logprob_parity_transformer_engine_spec(tiny, tp):
    """On a GPU with Transformer Engine: the TE layer spec (fused norms, grouped-GEMM experts) in float32 maps through
    the same tables (megarl.bridge.mapping.canonical_name)."""
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from megarl.megatron.model import te_available

    if not te_available():
        pytest.skip("transformer_engine does not import")
    _check(tiny, tp, 1, 1, ARCHS, True, f"te_tp{tp}", use_te=True)


@pytest.mark.slow
def test_linear_rope_scaling_and_single_file_checkpoint(tmp_path):
    """Llama with rope_type='linear' (megatron's seq_len_interpolation_factor) from one unsharded safetensors file."""
    import torch

    hf_dir = str(make_tiny_model("llama", tmp_path / "llama_linear", seed=9, max_shard_size=None,
                                 rope_scaling={"rope_type": "linear", "factor": 4.0}))
    tokens, lengths = sample_tokens(N, SEQ, seed=5)
    ref = hf_logprobs(hf_dir, tokens)
    results = run_ranks(f"{__name__}:parity_rank", 2, {"models": {"llama": hf_dir}, "tokens": tokens, "tp": 2, "pp": 1,
                                                        "ep": 1, "export": True}, timeout=600)
    mask = _real(lengths)
    tol = logprob_bound(hf_dir, tokens, mask)
    for r in results:
        lp, problems = r["llama"]
        diff = ((lp - ref).abs() * mask).max().item()
        print(f"[linear rope tp2] llama: max |logprob diff| = {diff:.2e} (bound {tol:.2e})")
        assert diff < tol and problems == [], (diff, tol, problems[:10])
