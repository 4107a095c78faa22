"""The planner's log-prob / entropy logits terms (megarl.plan.terms) against the memory megarl's own functions take:
the kernel's high-water mark of the resident size above a baseline (reset through /proc/self/clear_refs) while the old-logprob forward, the update's loss with its entropy metric and
its backward, and the update with an entropy bonus run on 1024 tokens x a 151,936 vocabulary (each tensor is hundreds
of MB, so the C allocator maps it apart and the resident size follows the live tensors), one fresh process per case."""
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.distributed import free_port
from megarl.plan.terms import forward_logits_bytes, update_logits_bytes

ROOT = Path(__file__).resolve().parents[2]
TOKENS, VOCAB = 1024, 151936

SCRIPT = r'''
import gc, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megarl.megatron.vocab_parallel import logprobs_from_logits, vocab_parallel_entropy

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

mode, dtype, tokens, vocab = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
hidden = torch.randn(tokens, 64, dtype=dtype)
w = torch.randn(vocab, 64, dtype=dtype, requires_grad=mode != "forward")
targets = torch.randint(0, vocab, (tokens,))
gc.collect()
with open("/proc/self/clear_refs", "w") as f:  # resets the kernel's high-water mark of the resident size
    f.write("5")
base = status("VmRSS")
if mode == "forward":  # the old/ref log-prob pass: log-probs only, no gradient
    with torch.no_grad():
        logits = hidden @ w.t()
        logprobs_from_logits(logits, targets, vocab)
        del logits
else:  # megarl.megatron.losses: log-probs with gradient, the entropy metric (with gradient only for a bonus)
    logits = hidden @ w.t()
    loss = -logprobs_from_logits(logits, targets, vocab).mean()
    with torch.set_grad_enabled(mode == "bonus"):
        entropy = vocab_parallel_entropy(logits if mode == "bonus" else logits.detach(), vocab).mean()
    if mode == "bonus":
        loss = loss - 0.01 * entropy
    del logits
    loss.backward()
weight_grad = 0 if mode == "forward" else w.numel() * w.element_size()  # a parameter's gradient, not an activation
print(status("VmHWM") - base - weight_grad)
'''


def _measure(mode: str, dtype: str) -> int:
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode, dtype, str(free_port()), str(TOKENS), str(VOCAB)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,pbytes", [("bfloat16", 2), ("float32", 4)])
def test_planned_logits_bytes_match_the_measured_peak(dtype, pbytes):
    planned = {"forward": forward_logits_bytes(TOKENS, VOCAB, 1, pbytes),
               "update": update_logits_bytes(TOKENS, VOCAB, 1, pbytes, False),
               "bonus": update_logits_bytes(TOKENS, VOCAB, 1, pbytes, True)}
    for mode, plan in planned.items():
        measured = _measure(mode, dtype)
        assert abs(measured - plan) / plan < 0.05, (mode, dtype, measured / (TOKENS * VOCAB), plan / (TOKENS * VOCAB))
