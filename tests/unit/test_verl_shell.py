"""megarl.convert_verl's shell reading: verl launch scripts expanded as bash would, without running them (expected
values worked out by hand from bash's rules)."""
from pathlib import Path

import pytest

from megarl.convert_verl.interpreter import read_script
from megarl.convert_verl.lexer import ShellParseError

ENV = {"HOME": "/home/u", "PATH": "/usr/bin"}


def _read(tmp_path: Path, text: str, env=None):
    script = tmp_path / "run.sh"
    script.write_text(text)
    return read_script(script, dict(ENV if env is None else env), cwd=str(tmp_path))


def test_assignments_defaults_arithmetic_and_env(tmp_path):
    r = _read(tmp_path, """set -x
export CUDA_DEVICE_MAX_CONNECTIONS=1
NNODES=${NNODES:-4}
max_prompt_length=$((1024 * 2))
max_response_length=$((1204 * 8))
budget=$(((max_prompt_length + max_response_length) * 10 / 3))
neg=$(( -7 / 2 ))
DATA=${DATA_HOME:-"${HOME}/verl"}/data.parquet
name='lit $HOME'
python3 -m verl.trainer.main_ppo \\
    data.train_files="${DATA}" \\
    data.max_prompt_length=${max_prompt_length} data.max_response_length=$max_response_length \\
    trainer.nnodes="$NNODES" a.budget=$budget a.neg=$neg a.name="$name" a.q='x y' $@ 2>&1 | tee log.txt
""", env={**ENV, "NNODES": "2"})
    # (2048 + 9632) * 10 / 3 = 38933 in bash's integer arithmetic; -7 / 2 = -3 (truncated toward zero)
    assert r.overrides == ["data.train_files=/home/u/verl/data.parquet", "data.max_prompt_length=2048",
                           "data.max_response_length=9632", "trainer.nnodes=2", "a.budget=38933", "a.neg=-3",
                           "a.name=lit $HOME", "a.q=x y"]
    assert not r.unresolved and r.module == "verl.trainer.main_ppo"


def test_arrays_in_arithmetic_read_as_their_first_element(tmp_path):
    # bash: $((a + 1)) with a=() is 1 (an empty array reads as ""), with a=(4 9) it is 5
    r = _read(tmp_path, """a=()
b=(4 9)
python3 -m verl.trainer.main_ppo x.n=$((a + 1)) x.m=$((b + 1))
""")
    assert r.overrides == ["x.n=1", "x.m=5"]


def test_arrays_strings_of_overrides_substitution_and_conditions(tmp_path):
    r = _read(tmp_path, """backend=megatron
ACTOR="
    actor_rollout_ref.actor.optim.lr=1e-6 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=32"
CRITIC="${ACTOR//actor_rollout_ref.actor/critic}"
DATA=(
    # a comment inside the array
    data.train_batch_size=8
    data.prompt_key="prompt text"
)
DATA+=(data.shuffle=False)
if [[ $backend == "megatron" ]]; then
    CONFIG_NAME=ppo_megatron_trainer
else
    CONFIG_NAME=ppo_trainer
fi
[ -f "/nonexistent/env.sh" ] && source /nonexistent/env.sh
true && n=5
cat > /tmp/never_written.yaml <<EOF
not: $(run me)
EOF
ray job submit --no-wait -- python3 -m recipe.dapo.main_dapo --config-name=$CONFIG_NAME \\
    $ACTOR $CRITIC "${DATA[@]}" actor_rollout_ref.rollout.n=$n
""")
    assert r.config_name == "ppo_megatron_trainer" and r.module == "recipe.dapo.main_dapo"
    assert r.overrides == ["actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                           "critic.optim.lr=1e-6", "critic.ppo_mini_batch_size=32", "data.train_batch_size=8",
                           "data.prompt_key=prompt text", "data.shuffle=False", "actor_rollout_ref.rollout.n=5"]
    assert not r.unresolved


def test_unresolved_values_are_named_never_kept_as_a_literal_dollar(tmp_path):
    r = _read(tmp_path, """if [ "$MODE" = fast ]; then tp=2; else tp=4; fi
exp=run-$(date +%Y%m%d)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 -m verl.trainer.main_ppo a.tp=$tp a.val="['$aime24']" a.exp=$exp a.x=$1 a.here=$here a.n=$((sp * 2))
""")
    got = {text.split("=")[0]: names for text, names, _ in r.unresolved}
    assert got == {"a.tp": ("tp",), "a.val": ("aime24",), "a.exp": ("$(date +%Y%m%d)",), "a.x": ("$1",),
                   "a.n": ("sp",)}
    assert r.overrides == [f"a.here={tmp_path}"]  # the script's own directory: pure commands are evaluated
    why = {t.split("=")[0]: w for t, _, w in r.unresolved}
    assert "cannot decide" in why["a.tp"] and "runs no commands" in why["a.exp"]


@pytest.mark.parametrize("text, message", [
    ("python3 -m verl.trainer.main_ppo a.b='unterminated\n", "unterminated"),
    ("if true; then\n  x=1\n", "ends inside a block"),
    ("echo no verl here\n", "no verl command"),
])
def test_a_script_that_cannot_be_read_to_its_end_is_an_error(tmp_path, text, message):
    with pytest.raises(ShellParseError, match=message):
        _read(tmp_path, text)


def test_and_chain_runs_the_verl_command_after_it(tmp_path):
    r = _read(tmp_path, "cd /tmp && python3 -m verl.trainer.main_ppo a.b=1 && echo done\n")
    assert r.overrides == ["a.b=1"]


# the default suite runs the first 40 scripts of the same random sequence; `make test-slow` all 150
@pytest.mark.parametrize("cases", [40, pytest.param(150, marks=pytest.mark.slow)])
def test_fuzz_mangled_scripts_read_or_refuse_never_raise_otherwise(tmp_path, cases):
    """verl's scripts with characters deleted and quotes, brackets, keywords and here-documents inserted at random:
    each is read, or refused with ShellParseError; nothing else escapes (no traceback for the user)."""
    import random

    from megarl.convert_verl import convert, gather

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
    sources = [p.read_text() for p in sorted(fixtures.rglob("*.sh"))]
    inserts = list("\"'$(){}[]\\`#;&|<>= \n") + ["$((", "${", "<<EOF\n", "if ", "fi", "for ", "done", "case ", "esac"]
    rng = random.Random(7)
    read = 0
    for i in range(cases):
        text = list(rng.choice(sources))
        for _ in range(rng.randint(1, 6)):
            k = rng.randrange(len(text))
            if rng.random() < 0.5:
                del text[k:k + rng.randint(1, 5)]
            else:
                text.insert(k, rng.choice(inserts))
        script = tmp_path / f"s{i}.sh"
        script.write_text("".join(text))
        try:
            inputs = gather([str(script)], dict(ENV))
        except ShellParseError:
            continue
        convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer, from_files=inputs.file_keys)
        read += 1
    assert read > cases / 5  # most mangled scripts still read (a deleted character rarely breaks the whole script)
