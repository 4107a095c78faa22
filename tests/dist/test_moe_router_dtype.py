"""model.moe_router_dtype reaches megatron's router: its logits are computed in the asked precision (fp64 here, on a
float32 model, so the change is visible on CPU), and the logprobs still match HF transformers."""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import logprob_bound
from tests.helpers.tiny_models import hf_logprobs, make_tiny_model, sample_tokens


pytestmark = pytest.mark.parity


def _recording(gating, seen: list):
    def wrapped(x):
        logits = gating(x)
        seen.append(str(logits.dtype))
        return logits
    return wrapped


def router_rank(hf_dir: str, tokens):
    from megarl.config import load_unchecked
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.workers import build_options

    init_model_parallel(Layout(), seed=1)
    out = {}
    for router_dtype in ("fp64", None):
        cfg = load_unchecked(data={"model": {"path": hf_dir, "moe_router_dtype": router_dtype}})
        model, _ = build_and_load(hf_dir, **{**build_options(cfg), "dtype": torch.float32})
        model.eval()
        seen: list = []
        routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
        for router in routers:
            router.gating = _recording(router.gating, seen)
        out[router_dtype] = (token_logprobs(model, tokens, micro_batch_size=2), sorted(set(seen)), len(routers))
    return out


@pytest.mark.slow  # two tiny MoE builds: about 70 s on 2 busy cores
def test_router_dtype_reaches_the_router(tmp_path):
    hf_dir = str(make_tiny_model("qwen3_moe", tmp_path / "moe", seed=0))
    tokens, lengths = sample_tokens(3, 16, seed=2)
    (out,) = run_ranks(f"{__name__}:router_rank", 1, {"hf_dir": hf_dir, "tokens": tokens}, timeout=300)
    (lp64, dtypes64, n_routers), (lp, dtypes, _) = out["fp64"], out[None]
    assert n_routers >= 1 and dtypes64 == ["torch.float64"] and dtypes == ["torch.float32"]
    mask = torch.arange(15)[None, :] < (lengths[:, None] - 1)
    # an fp64 router rounds less than the fp32 one: the same routes, logprobs within the float32 bound (a route
    # flipped at a near tie would not be rounding; the tiny model's router margins keep it from happening here)
    tol = logprob_bound(hf_dir, tokens, mask)
    diffs = (((lp64 - hf_logprobs(hf_dir, tokens)).abs() * mask).max().item(), ((lp64 - lp).abs() * mask).max().item())
    print(f"[measured] fp64 router vs HF {diffs[0]:.2e}, vs fp32 router {diffs[1]:.2e} (bound {tol:.2e})")
    assert max(diffs) < tol, (diffs, tol)
