"""The commands in README.md and docs/ are real: every `megarl ...` line of a shell block (and every `$ megarl ...` line
of an output block) parses with the CLI's own argparse parsers, every `make TARGET` named exists in the Makefile, and
docs/recipes.md's `megarl validate` example is what running it prints."""
import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*```(\S*)")
SEPARATORS = {"&&", "||", ";", "|", "&"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def shell_lines(text: str) -> list[str]:
    """Command lines of a page's code blocks: every line of a bash/sh/shell block, the `$ ` lines of any other block
    (output shown with its command), backslash continuations joined."""
    out, lang, pending = [], None, ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            lang = m.group(1) if lang is None else None
            pending = ""
            continue
        if lang is None:
            continue
        stripped = line.strip()
        if pending:
            stripped = pending + " " + stripped
        elif stripped.startswith("$ "):
            stripped = stripped[2:]
        elif lang not in ("bash", "sh", "shell", "console"):
            continue
        if stripped.endswith("\\"):
            pending = stripped[:-1].strip()
            continue
        pending = ""
        out.append(stripped)
    return out


def commands(line: str, program: str) -> list[list[str]]:
    """The argument lists of `program` (after its name) in one shell line: split at ;, &&, ||, |, &, with leading
    VAR=value assignments skipped; `python -m megarl` counts as megarl."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: not a shell line
        return []
    found, segment = [], []
    for word in words + [";"]:
        if word not in SEPARATORS:
            segment.append(word)
            continue
        while segment and re.match(r"^[A-Z_][A-Z0-9_]*=", segment[0]):
            segment.pop(0)
        if segment[:3] == ["python", "-m", program]:
            segment = segment[2:]
        if segment and segment[0] == program:
            found.append(segment[1:])
        segment = []
    return found


def parse_megarl(argv: list[str]) -> None:
    """argparse's verdict on `megarl ARGV`, with the parser each command really uses (verify, doctor and plan have
    their own); SystemExit with a non-zero code is a failure (--help exits 0)."""
    from megarl import cli, doctor, verify
    from megarl.plan import add_arguments

    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "verify":
        verify.parse_args(rest)
    elif command == "doctor":
        doctor.build_parser().parse_args(rest)
    elif command == "plan":
        plan = argparse.ArgumentParser(prog="megarl plan")
        add_arguments(plan)
        plan.parse_intermixed_args(rest)
    else:
        cli.build_parser().parse_args(argv)


def _parses(argv: list[str]) -> bool:
    try:
        parse_megarl(argv)
    except SystemExit as exc:
        return exc.code in (0, None)
    return True


def test_the_command_reader_and_the_parser_can_fail():
    assert commands("CUDA_VISIBLE_DEVICES=0 megarl train R a=1 && megarl report RUN_DIR  # then", "megarl") == [
        ["train", "R", "a=1"], ["report", "RUN_DIR"]]
    assert commands("python -m megarl validate R", "megarl") == [["validate", "R"]]
    assert shell_lines("```bash\nmegarl plan R \\\n  --nodes 1\n```\n```\n$ megarl report X\nmegarl output\n```") == [
        "megarl plan R --nodes 1", "megarl report X"]
    assert _parses(["train", "RECIPE", "trainer.total_steps=5"]) and _parses(["plan", "R", "--nodes", "1"])
    assert not _parses(["train"]) and not _parses(["trian", "R"]) and not _parses(["plan", "R", "--nodez", "1"])
    assert not _parses(["verify", "--hff", "DIR"]) and not _parses(["doctor", "--nope"])


def _all_commands(program: str) -> list[tuple[str, list[str]]]:
    return [(f"{page.relative_to(ROOT)}: {line}", argv) for page in pages() for line in shell_lines(page.read_text())
            for argv in commands(line, program)]


def test_every_megarl_command_in_the_docs_parses(capsys):
    found = _all_commands("megarl")
    assert len(found) > 50  # the docs' blocks were read
    bad = [where for where, argv in found if not _parses(argv)]
    capsys.readouterr()  # argparse's usage lines
    assert not bad, "does not parse with megarl's CLI:\n" + "\n".join(bad)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for m in re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.MULTILINE)}


def _make_targets(argv: list[str]) -> list[str]:
    """The targets of `make ARGV`: words that are not options or VAR=value assignments."""
    return [w for w in argv if not w.startswith("-") and "=" not in w]


def test_every_make_target_named_in_the_docs_exists():
    targets = makefile_targets()
    assert {"env", "demo", "demo-real", "test", "clean-env"} <= targets
    named = [(where, t) for where, argv in _all_commands("make") for t in _make_targets(argv)]
    for page in pages():  # `make X` in the prose's inline code too
        for span in re.findall(r"`(make [^`]+)`", page.read_text()):
            named += [(f"{page.relative_to(ROOT)}: `{span}`", t) for argv in commands(span, "make")
                      for t in _make_targets(argv)]
    assert len(named) > 10
    missing = [f"{where} (no target {t!r})" for where, t in named if t not in targets]
    assert not missing, "\n".join(missing)


def _validate_example() -> tuple[list[str], list[str]]:
    """docs/recipes.md's validate example: (the command's words, the output lines the page shows)."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    block = re.search(r"```\n(\$ megarl validate .*?)```", text, re.DOTALL).group(1).splitlines()
    command, rest = block[0], block[1:]
    while command.endswith("\\"):
        command = command[:-1] + rest.pop(0).strip()
    return shlex.split(command[2:]), rest


def test_the_validate_example_is_what_validate_prints():
    argv, shown = _validate_example()
    assert argv[:2] == ["megarl", "validate"] and shown, argv
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "megarl", *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 1  # the example shows problems
    printed = [line.rstrip() for line in (out.stdout + out.stderr).strip().splitlines()]
    assert printed == [line.rstrip() for line in shown]


def test_the_gpu_page_says_what_ran_where():
    """docs/gpu.md's H100 figures are an earlier release's; the page must not also say no GPU ever ran, and each
    H100 figure names its release."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert "No GPU was available" not in text
    for para in (" ".join(p.split()) for p in re.split(r"\n\s*\n", text)):
        if re.search(r"\bH100\b[^.]*\bmeasured\b|measured[^.]*\bH100\b", para):
            assert "earlier release" in para, para
