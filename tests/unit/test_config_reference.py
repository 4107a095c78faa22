"""docs/reference/configuration.md is what the schema and convert-verl's rules generate now (tools/config_reference.py),
and what it says holds: every default is the value of a freshly built MegarlConfig(), every verl key convert-verl maps
is listed beside its megarl key, and every derived value `megarl validate` prints is explained."""
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference" / "configuration.md"
FIXTURES = ROOT / "tests" / "fixtures" / "verl"
AR = "actor_rollout_ref."
CELL = re.compile(r"(?<!\\)\|")  # a table cell boundary: a pipe not escaped as \|
MAPPED = re.compile(r"^(?:\(verl default\) )?(\S+) = .*? -> (\S+) = ")  # a `mapped` line of a conversion


def reference_rows(text: str) -> dict:
    """{key: [cells]} of every key row of the reference's tables (cells unescaped, stripped)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip().replace("\\|", "|") for c in CELL.split(line)[1:-1]]
            rows[cells[0].strip("`")] = cells
    return rows


def fresh_default(cfg: BaseModel, key: str):
    """`key`'s value in MegarlConfig(); under a section that is null by default, its class's own default."""
    node = cfg
    for part in key.split("."):
        value = getattr(node, part)
        if value is None and part != key.rsplit(".", 1)[-1]:
            annotation = type(node).model_fields[part].annotation
            value = next(a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel))()
        node = value
    return node


def default_mismatches(text: str) -> list[str]:
    from megarl.config.schema import MegarlConfig

    cfg = MegarlConfig()
    bad = []
    for key, cells in reference_rows(text).items():
        if "." not in key:  # the derived values' table
            continue
        try:
            want = repr(fresh_default(cfg, key))
        except AttributeError:
            bad.append(f"{key}: listed, but MegarlConfig() has no such key")
            continue
        if cells[2] != want:
            bad.append(f"{key}: the reference says {cells[2]!r}, MegarlConfig() has {want}")
    return bad


def test_the_committed_reference_is_fresh():
    out = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_default_in_the_reference_is_a_fresh_configs():
    text = REFERENCE.read_text()
    assert len(reference_rows(text)) > 300  # the tables were read (a parse that finds nothing checks nothing)
    assert not default_mismatches(text), "\n".join(default_mismatches(text))


def test_a_sections_own_default_is_the_one_listed():
    rows = reference_rows(REFERENCE.read_text())
    # the parent's default_factory overrides OptimConfig's own lr (1e-6): the value a run gets is listed
    assert rows["critic.optim.lr"][2] == "1e-05"
    assert rows["sft.optim.lr"][2] == rows["rm.optim.lr"][2] == "0.0001"
    assert rows["actor.optim.lr"][2] == "1e-06"


def test_every_key_and_its_verl_names_are_listed():
    sys.path.insert(0, str(ROOT / "tools"))
    from config_reference import render

    text = render()
    for key in ("rollout.delta_full_every", "actor.optim.lr", "rollout.multi_turn.format", "sft.target_loss"):
        assert f"| `{key}` |" in text, key
    row = next(line for line in text.splitlines() if line.startswith("| `rollout.prompt_length` |"))
    assert "`data.max_prompt_length`" in row  # convert-verl's rule for verl's key


# Values that reach each kind of rule's mapping branch: numbers, switches, paths, and the words rules accept.
PROBES = (None, 0, 1, 2, 4, 0.5, 1.5, 2.0, -1, True, False, "x", "auto", "cosine", "full", "selective", "fp32",
          "bfloat16", "vanilla", "token", "sequence", "R2", "disabled", "safetensors", "dummy", "filter", "left",
          "disable", ["console", "tensorboard", "wandb"], ["x.parquet"])


def _probe(key: str, value):
    from megarl.convert_verl.record import Conversion
    from megarl.convert_verl.rules import rule_for

    c = Conversion()
    try:
        rule_for(key)(c, key, value)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError):  # a value the rule cannot use
        return Conversion()
    return c


def test_every_rule_declares_the_keys_it_writes():
    """The reference's verl column reads each rule's declared targets; a rule writing a key it does not declare
    would leave that key's verl name out."""
    from megarl.convert_verl.rules import known_keys, rule_for

    keys = known_keys()
    assert len(keys) > 300
    undeclared, written = [], 0
    for key in keys:
        rule = rule_for(key)
        assert hasattr(rule, "targets"), f"{key}: its rule declares no targets (rule_kinds.sets)"
        for value in PROBES:
            for megarl_key in _probe(key, value).sources:
                written += 1
                if megarl_key not in rule.targets:
                    undeclared.append(f"{key} = {value!r} writes {megarl_key}, declared {rule.targets}")
    assert written > 300 and not undeclared, "\n".join(undeclared)


def _conversions():
    """Conversions of real verl inputs: the fixture scripts, and every key of verl's generated Megatron trainer
    config with its own default value (one conversion per key)."""
    from megarl.convert_verl import convert, gather

    for script in sorted(FIXTURES.glob("*.sh")) + sorted((FIXTURES / "upstream").glob("*.sh")):
        inputs = gather([str(script)], {})
        yield convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer,
                      from_files=inputs.file_keys)

    def flat(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict) and v:
                yield from flat(v, prefix + k + ".")
            else:
                yield prefix + k, v

    generated = yaml.safe_load((FIXTURES / "upstream" / "_generated_ppo_megatron_trainer.yaml").read_text())
    for key, value in flat(generated):
        yield convert({key: value}, defaults={}, check=False)


def test_every_key_convert_verl_maps_shows_its_verl_name():
    from megarl.convert_verl.rules import known_keys

    rows = reference_rows(REFERENCE.read_text())
    pairs = set()
    for c in _conversions():
        for line in c.mapped:
            verl_key, megarl_key = MAPPED.match(line).groups()
            pairs.add((verl_key, megarl_key))
    for key in known_keys():  # every rule, over the probe values
        for value in PROBES:
            pairs |= {(key, megarl_key) for megarl_key in _probe(key, value).sources}
    assert len(pairs) > 200
    missing = [f"{megarl_key}: `{verl_key}` missing from its verl column" for verl_key, megarl_key in sorted(pairs)
               if f"`{verl_key.replace(AR, 'arr.')}`" not in rows[megarl_key][5]]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("verl_key,value,megarl_key", [
    (AR + "actor.optim.eps", 1e-6, "actor.optim.eps"),
    ("critic.optim.eps", 1e-7, "critic.optim.eps"),
    (AR + "actor.router_replay.mode", "R2", "actor.router_replay.mode"),
    (AR + "model.tokenizer_path", "tok", "model.tokenizer_path"),
    (AR + "model.lora.rank", 8, "actor.lora.rank"),
    (AR + "model.lora.alpha", 16, "actor.lora.alpha"),
    (AR + "model.lora.dropout", 0.05, "actor.lora.dropout"),
    (AR + "rollout.checkpoint_engine.update_weights_bucket_megabytes", 1024, "rollout.update_weights_bucket_megabytes"),
    (AR + "rollout.quantization", "fp8", "rollout.quantization"),
    ("trainer.max_critic_ckpt_to_keep", 3, "checkpoint.keep_last_k"),
])
def test_verl_keys_with_a_megarl_equivalent_are_mapped(verl_key, value, megarl_key):
    from megarl.convert_verl import convert
    from megarl.convert_verl.record import get_key

    c = convert({verl_key: value}, defaults={}, check=False)
    assert not c.refused, c.refused
    assert get_key(c.recipe, megarl_key) == value


def test_every_derived_value_is_explained():
    from megarl.config import derived
    from megarl.config.resolve import DERIVED_MEANINGS
    from megarl.config.schema import MegarlConfig

    rows = reference_rows(REFERENCE.read_text())
    cpu = set(derived(MegarlConfig()))
    gpu = set(derived(MegarlConfig(trainer={"device": "cuda"})))
    assert "engine_devices" in gpu - cpu  # only GPU runs list the engines' devices
    assert set(DERIVED_MEANINGS) == cpu | gpu
    for key in cpu | gpu:
        assert key in rows and rows[key][1], key
