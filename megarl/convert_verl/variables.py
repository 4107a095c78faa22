"""What the reader knows of a script's shell variables: values (strings and arrays), values that cannot be known (with
why), and the marks an unresolved name leaves inside expanded text.

An unresolved expansion is kept as \\x00name\\x00 inside the text, so it survives word splitting and the caller can
refuse the override it sits in by the variable's name instead of keeping a literal `$` or an empty value.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

MARK = "\x00"
_MARKED = re.compile(r"\x00([^\x00]*)\x00")
NOT_SET = "not set in the script or the environment"


def marker(name: str) -> str:
    """The stand-in for an unresolved name (whitespace encoded, so that word splitting never cuts it)."""
    return MARK + re.sub(r"[ \t\n]", chr(1), name) + MARK


def _decode(name: str) -> str:
    return name.replace(chr(1), " ")


def unresolved_names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_decode(n) for n in _MARKED.findall(text)))


def show(text: str) -> str:
    """A marked text as the user wrote it: \x00name\x00 -> ${name} ($(cmd) and $1 as they are)."""
    return _MARKED.sub(lambda m: (_decode(m.group(1)) if m.group(1).startswith("$") else
                                  "${" + _decode(m.group(1)) + "}"), text)


def is_marker(text: str) -> bool:
    """Whether the whole text is one unresolved name's mark."""
    return _MARKED.fullmatch(text) is not None


class Unknown:
    """A variable whose value cannot be known (why is reported with the name)."""

    def __init__(self, why: str):
        self.why = why


Value = Union[str, list, Unknown]


class Variables:
    """The script's variables over the process environment, the directory it runs in and how deep the reader is in
    code that may or may not run (`uncertain`: an assignment there makes the name unknown unless it changes nothing)."""

    def __init__(self, script: Optional[Path], environ: Optional[dict] = None, cwd: Optional[str] = None):
        self.script = script
        self.cwd = cwd or os.getcwd()
        base_env = dict(os.environ if environ is None else environ)
        base_env.setdefault("PWD", self.cwd)
        self.env: dict[str, Value] = dict(base_env)
        self.why: dict[str, str] = {}  # unresolved name -> why, reported with the override that names it
        self.uncertain = 0

    def get(self, name: str) -> Value:
        if name in self.env:
            return self.env[name]
        return Unknown(self.why.get(name, NOT_SET))

    def set(self, name: str, value: Value) -> None:
        if self.uncertain:
            old = self.env.get(name)
            if old != value:
                self.env[name] = Unknown("assigned under a condition the converter cannot decide")
            return
        self.env[name] = value

    def forget(self, names, why: str) -> None:
        """Names assigned by code that is not evaluated: unknown from here on."""
        for name in names:
            self.env[name] = Unknown(why)

    def scalar(self, name: str) -> str:
        """$name: the value (an array's first item), or the name's mark when it cannot be known."""
        return self.text(name, self.get(name))

    def text(self, name: str, value: Value) -> str:
        """A value as text; an unknown one is recorded (why) and becomes the name's mark."""
        if isinstance(value, Unknown):
            self.why.setdefault(name, value.why)
            return marker(name)
        if isinstance(value, list):
            return value[0] if value else ""
        return value
