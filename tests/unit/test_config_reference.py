"""docs/reference/configuration.md is what the schema and convert-verl's rules generate now (tools/config_reference.py):
a key added, removed or redescribed without regenerating the reference fails here."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_reference_is_fresh():
    out = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_key_and_its_verl_names_are_listed():
    sys.path.insert(0, str(ROOT / "tools"))
    from config_reference import render

    text = render()
    for key in ("rollout.delta_full_every", "actor.optim.lr", "rollout.multi_turn.format", "sft.target_loss"):
        assert f"| `{key}` |" in text, key
    row = next(line for line in text.splitlines() if line.startswith("| `rollout.prompt_length` |"))
    assert "`data.max_prompt_length`" in row  # convert-verl's rule for verl's key, found by applying it
