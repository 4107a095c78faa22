"""Read a verl launch script the way bash would, without running anything: the key=value overrides of its verl command.

verl's example scripts build their command lines from shell variables: assignments (`n=8`, `export X=1`),
`${VAR:-default}`, `$((a * b))` arithmetic, strings and arrays of overrides expanded unquoted (`$ACTOR_CONFIG`,
`"${DATA[@]}"`), `${VAR//old/new}`, `if [[ $backend == megatron ]]`, `[ -f env.sh ] && source env.sh`, `&&` chains and
line continuations. `read_script` interprets that subset: variables come from the script's assignments and then the
process environment (as bash's would); command substitutions are evaluated only for the pure commands pwd, dirname,
basename, echo and `cd DIR && pwd`; nothing else is run. Whatever cannot be resolved (an unset variable, `$(date)`,
a positional `$1`, a variable assigned under a condition that cannot be decided) stays marked, so the caller refuses
the override by the variable's name instead of keeping a literal `$` or an empty value.

    read = read_script(Path("run_qwen3moe-30b_megatron_96gb.sh"))
    read.overrides      # ["data.train_files=/home/u/verl/dataset/dapo-math-17k.parquet", ...]
    read.unresolved     # [("data.val_files=['${aime24_test_path}']", ("aime24_test_path",), "not set ...")]
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megarl.convert_verl.expansion import expand, resolve_dir
from megarl.convert_verl.lexer import ArrayAssign, ShellParseError
from megarl.convert_verl.parser import DECLARES, AndOr, For, If, Opaque, Simple, assigned, assignment, parse
from megarl.convert_verl.variables import MARK, NOT_SET, Unknown, Variables, marker, show, unresolved_names

_MODULE = re.compile(r"^(verl|recipe)\.[\w.]*main\w*$")
_SCRIPT = re.compile(r"(^|/)(verl|recipe)/[\w/]*main_\w+\.py$")
_CONFIG_FLAGS = ("--config-path", "--config-name", "-cp", "-cn")
_NOT_BUILTIN = object()


@dataclass
class ScriptRead:
    """What a verl script asks for: resolved overrides, overrides naming unresolved variables, the config flags."""

    overrides: list[str] = field(default_factory=list)
    unresolved: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)  # (text as written, names, why)
    config_path: Optional[str] = None
    config_name: Optional[str] = None
    module: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    script: Optional[Path] = None


class _Exit(Exception):
    pass


class Interpreter:
    """Runs parsed commands over the script's variables, recording each verl command line it reaches. A status is
    True/False where the reader can decide it and None where it cannot (then what depends on it runs as uncertain)."""

    def __init__(self, script: Optional[Path], environ: Optional[dict] = None, cwd: Optional[str] = None):
        self.variables = Variables(script, environ, cwd)
        self.commands: list[tuple[list[str], bool]] = []  # verl command fields, found under an undecided condition
        self.sourced: set = set()

    def expand(self, raw: str, split: bool = True) -> list[str]:
        return expand(self.variables, raw, split)

    @contextmanager
    def uncertain(self, when: bool = True):
        """Code run inside may or may not run in bash: its assignments make their names unknown."""
        self.variables.uncertain += bool(when)
        try:
            yield
        finally:
            self.variables.uncertain -= bool(when)

    def run(self, items: list) -> Optional[bool]:
        status: Optional[bool] = True
        for item in items:
            status = self.run_item(item)
        return status

    def run_item(self, item) -> Optional[bool]:
        if isinstance(item, AndOr):
            return self.run_and_or(item)
        if isinstance(item, list):
            return self.run(item)
        if isinstance(item, If):
            return self.run_if(item)
        if isinstance(item, For):
            return self.run_for(item)
        if isinstance(item, Opaque):
            self.variables.forget(item.assigned, f"assigned inside a {item.what} block the converter does not "
                                                 "evaluate")
            return None
        if isinstance(item, Simple):
            return self.run_simple(item)
        raise AssertionError(item)

    def run_and_or(self, item: AndOr) -> Optional[bool]:
        status = self.run_pipeline(item.parts[0])
        for k in range(1, len(item.parts), 2):
            op, nxt = item.parts[k], item.parts[k + 1]
            if status is None:  # undecided: the rest may or may not run
                with self.uncertain():
                    self.run_pipeline(nxt)
            elif (op == "&&") == status:
                status = self.run_pipeline(nxt)
        return status

    def run_pipeline(self, pipeline: list) -> Optional[bool]:
        status = None
        for cmd in pipeline:
            status = self.run_item(cmd)
        return status if len(pipeline) == 1 else True

    def run_if(self, node: If) -> Optional[bool]:
        undecided = 0
        for cond, body in node.branches:
            decided = True if cond is None else self.run(cond)
            if decided is None:
                undecided += 1
                with self.uncertain():
                    self.run(body)
            elif decided:
                with self.uncertain(undecided > 0):
                    self.run(body)
                return True
        return True

    def run_for(self, item: For) -> Optional[bool]:
        values = None if item.items is None else [f for w in item.items for f in self.expand(w.raw)]
        if values is None or any(MARK in v for v in values):
            self.variables.forget((assigned(item.body) | {item.var}) - {""},
                                  "assigned in a for loop the converter cannot unroll")
            return None
        for value in values:
            self.variables.set(item.var, value)
            self.run(item.body)
        return True

    def run_simple(self, cmd: Simple) -> Optional[bool]:
        if not cmd.words:
            for a in cmd.assigns:
                self.assign(a)
            return True
        args = [f for w in cmd.words for f in self.expand(w.raw)]
        if not args:
            return True
        if args[0] in DECLARES:
            for a in filter(None, (assignment(w.raw) for w in cmd.words[1:])):
                self.assign(a)
            return True
        status = self.builtin(args)
        if status is not _NOT_BUILTIN:
            return status
        self.find_verl_command(args)
        return True  # other commands are not run; assume they succeed

    def builtin(self, args: list[str]):
        """The builtins that change what the reader knows; _NOT_BUILTIN for any other command."""
        name, v = args[0], self.variables
        if name == "unset":
            for a in args[1:]:
                if not a.startswith("-"):
                    v.env.pop(a, None)
            return True
        if name in ("[", "[[", "test"):
            return _test(args, v.cwd)
        if name in ("true", ":", "false"):
            return name != "false"
        if name == "exit":
            if v.uncertain:
                return None
            raise _Exit()
        if name in ("source", "."):
            return self.source(args[1:])
        if name == "cd" and len(args) == 2 and MARK not in args[1] and not v.uncertain:
            v.cwd = resolve_dir(v.cwd, args[1])
            v.env["PWD"] = v.cwd
            return True
        return _NOT_BUILTIN

    def find_verl_command(self, args: list[str]) -> None:
        """Record the command when it runs verl: `python -m verl...main_ppo ...` or a path to a verl main_*.py."""
        start = next((k + 1 for k, a in enumerate(args[:-1]) if a == "-m" and _MODULE.match(args[k + 1])), None)
        if start is None:
            start = next((k for k, a in enumerate(args) if _SCRIPT.search(a)), None)
        if start is not None:
            self.commands.append((args[start:], bool(self.variables.uncertain)))

    def assign(self, a) -> None:
        v = self.variables
        if isinstance(a, ArrayAssign):
            items = [f for w in a.words for f in self.expand(w.raw)]
            old = v.env.get(a.name) if a.append else None
            base = old if isinstance(old, list) else ([old] if isinstance(old, str) else [])
            v.set(a.name, base + items)
            return
        name, append, word = a
        value = "".join(self.expand(word.raw, split=False))
        if append:
            old = v.get(name)
            if isinstance(old, list):
                v.set(name, old + [value])
                return
            value = (marker(name) if isinstance(old, Unknown) else old) + value
        v.set(name, value)

    def source(self, args: list[str]) -> Optional[bool]:
        if not args or MARK in args[0]:
            return None
        path = Path(self.variables.cwd, os.path.expanduser(args[0]))
        if not path.is_file() or path.resolve() in self.sourced:
            return None if not path.is_file() else True
        self.sourced.add(path.resolve())
        self.run(parse(path.read_text()))
        return True


def _test(args: list[str], cwd: str) -> Optional[bool]:
    """`[ ... ]`, `[[ ... ]]` or `test ...` when the reader can decide it; None when it cannot."""
    end = {"[": "]", "[[": "]]"}.get(args[0])
    body = args[1:-1] if end and args[-1:] == [end] else args[1:]
    if any(x in body for x in ("&&", "||", "-a", "-o", "!", "(", ")")):
        return None
    if any(MARK in x for x in body):
        return None
    if len(body) == 3 and body[1] in ("==", "=", "!="):
        return (body[0] == body[2]) == (body[1] != "!=")
    if len(body) == 3 and body[1] in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
        try:
            a, b = int(body[0]), int(body[2])
        except ValueError:
            return None
        return {"-eq": a == b, "-ne": a != b, "-lt": a < b, "-le": a <= b, "-gt": a > b, "-ge": a >= b}[body[1]]
    if len(body) == 2 and body[0] in ("-n", "-z"):
        return (body[1] != "") == (body[0] == "-n")
    if len(body) == 2 and body[0] in ("-f", "-d", "-e"):
        p = Path(cwd, os.path.expanduser(body[1]))
        return {"-f": p.is_file, "-d": p.is_dir, "-e": p.exists}[body[0]]()
    if len(body) == 1:
        return body[0] != ""
    return None


def read_script(path: Path, environ: Optional[dict] = None, cwd: Optional[str] = None) -> ScriptRead:
    """The verl command of a launch script, its words expanded as bash would (see the module docstring).

    Raises ShellParseError when the script cannot be read to its end or runs no verl command."""
    text = path.read_text()
    interp = Interpreter(path, environ, cwd)
    items = parse(text)
    try:
        interp.run(items)
    except _Exit:
        pass
    if not interp.commands:
        raise ShellParseError(f"{path}: no verl command found (python3 -m verl.trainer.main_ppo ... or a recipe's "
                              "main module); nothing converted")
    fields, uncertain = interp.commands[-1]
    read = ScriptRead(module=fields[0], script=path)
    if len(interp.commands) > 1:
        read.notes.append(f"{path.name} runs verl {len(interp.commands)} times; the last command line is converted")
    if uncertain:
        read.notes.append(f"{path.name}: the verl command runs under a condition the converter cannot decide")
    _sort_arguments(read, fields[1:], interp.variables.why)
    return read


def _sort_arguments(read: ScriptRead, args: list[str], why: dict) -> None:
    """The verl command's arguments into the config flags, the overrides, and those naming unresolved names."""
    k = 0
    while k < len(args):
        arg = args[k]
        flag = next((f for f in _CONFIG_FLAGS if arg == f or arg.startswith(f + "=")), None)
        if flag:
            if arg == flag:
                value = args[k + 1] if k + 1 < len(args) else ""
                k += 1
            else:
                value = arg[len(flag) + 1:]
            if MARK in value:
                read.unresolved.append((f"{flag}={show(value)}", unresolved_names(value), _why(why, value)))
            elif flag in ("--config-path", "-cp"):
                read.config_path = value
            else:
                read.config_name = value
        elif MARK in arg:
            read.unresolved.append((show(arg), unresolved_names(arg), _why(why, arg)))
        elif arg:
            read.overrides.append(arg)
        k += 1


def _why(why: dict, text: str) -> str:
    return "; ".join(f"{show(marker(n))}: {why.get(n, NOT_SET)}"
                     for n in unresolved_names(text))
