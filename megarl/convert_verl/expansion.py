"""Word expansion as bash does it, over the variables the reader knows: quotes, `$name`, `${...}` with its defaults,
replacements and trims, `$((...))` arithmetic, arrays (`"${A[@]}"` one field per item) and word splitting.

Command substitutions are evaluated only for the pure commands pwd, dirname, basename, echo and `cd DIR && pwd`;
nothing is run. Whatever cannot be known becomes its name's mark (megarl.convert_verl.variables).
"""
from __future__ import annotations

import ast
import os
import re
from typing import Callable, Optional

from megarl.convert_verl.lexer import ShellParseError, skip_quoted
from megarl.convert_verl.parser import Simple, parse
from megarl.convert_verl.variables import MARK, Unknown, Value, Variables, is_marker, marker, show

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL = re.compile(r"\d+|[@*#?]")
_SUBSCRIPT = re.compile(r"\[([^\]]*)\]")
_QUOTED_ARRAY = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}")
_DEFAULT_OPS = (":-", ":=", ":+", ":?", "-", "=", "+", "?")  # in the order bash tries them (the longest first)
_GLOB = "*?["


def resolve_dir(cwd: str, path: str) -> str:
    """`cd path` from cwd."""
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))


class _Fields:
    """The fields one word expands to, built piece by piece (unquoted expansions split at blanks)."""

    def __init__(self, split: bool):
        self.split = split
        self.fields: list[str] = []
        self.cur: list[str] = []
        self.have = False  # a field is started (quotes make an empty field)

    def add(self, text: str, splittable: bool) -> None:
        if not splittable or not self.split:
            self.cur.append(text)
            self.have = True
            return
        for k, part in enumerate(re.split(r"[ \t\n]+", text)):
            if k > 0:
                if self.have or self.cur:
                    self.fields.append("".join(self.cur))
                self.cur, self.have = [], False
            if part:
                self.cur.append(part)
                self.have = True

    def add_each(self, items: list[str]) -> None:
        """"${A[@]}": each item its own field (the first joins what precedes it, the last what follows)."""
        for k, item in enumerate(items):
            if k > 0:
                self.fields.append("".join(self.cur))
                self.cur = []
            self.cur.append(item)
            self.have = True

    def done(self) -> list[str]:
        if self.have or self.cur:
            self.fields.append("".join(self.cur))
        return self.fields


def expand(v: Variables, raw: str, split: bool = True) -> list[str]:
    """bash's expansion of one word: the fields it becomes (one, unless unquoted expansions split)."""
    fields = _Fields(split)
    i = 0
    while i < len(raw):
        i = _expand_at(v, raw, i, fields)
    return fields.done()


def _expand_at(v: Variables, raw: str, i: int, fields: _Fields) -> int:
    """Expand the piece of `raw` at i into `fields`; the index after it."""
    c = raw[i]
    if c == "\\" and i + 1 < len(raw):
        fields.add(raw[i + 1], False)
        return i + 2
    if c == "'":
        j = raw.index("'", i + 1)
        fields.add(raw[i + 1:j], False)
        return j + 1
    if c == '"':
        j = skip_quoted(raw, i)
        inner = raw[i + 1:j - 1]
        m = _QUOTED_ARRAY.fullmatch(inner)
        if m:
            fields.add_each(_items(v, m.group(1)))
        else:
            fields.add(_expand_dquoted(v, inner), False)
        return j
    if c == "$":
        text, j = _dollar(v, raw, i)
        fields.add(text, True)
        return j
    if c == "`":
        j = skip_quoted(raw, i)
        fields.add(_command_subst(v, raw[i + 1:j - 1]), True)
        return j
    fields.add(c, False)
    return i + 1


def _items(v: Variables, name: str) -> list[str]:
    """The items of "${name[@]}": an array's, a string as one, an unknown name's mark."""
    value = v.get(name)
    if isinstance(value, Unknown):
        return [v.text(name, value)]
    return value if isinstance(value, list) else [value]


def _expand_dquoted(v: Variables, inner: str) -> str:
    """The text between double quotes, expanded (no splitting)."""
    out, i, n = [], 0, len(inner)
    while i < n:
        c = inner[i]
        if c == "\\" and i + 1 < n and inner[i + 1] in '$`"\\\n':
            out.append("" if inner[i + 1] == "\n" else inner[i + 1])
            i += 2
        elif c == "$":
            text, i = _dollar(v, inner, i)
            out.append(text)
        elif c == "`":
            j = skip_quoted(inner, i)
            out.append(_command_subst(v, inner[i + 1:j - 1]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _expand_word(v: Variables, text: str) -> str:
    """The word of ${x:-word}: quotes removed, expansions made (no splitting)."""
    return "".join(expand(v, text, split=False)) if text else ""


def _dollar(v: Variables, s: str, i: int) -> tuple[str, int]:
    """Expand the $-construct at s[i]; return its text and the index after it."""
    n = len(s)
    if i + 1 >= n:
        return "$", i + 1
    c = s[i + 1]
    if c in "({":
        j = skip_quoted(s, i)
        if s.startswith("$((", i):
            return _arith(v, s[i + 3:j - 2]), j
        return (_command_subst(v, s[i + 2:j - 1]) if c == "(" else _brace(v, s[i + 2:j - 1])), j
    m = NAME.match(s, i + 1)
    if m:
        return v.scalar(m.group()), m.end()
    if c in "@*":
        return "", i + 2  # the arguments the script was started with: none here
    if c == "#":
        return "0", i + 2
    if c == "0" and v.script is not None:
        return str(v.script), i + 2
    if c.isdigit() or c in "?$!-":
        return marker(f"${c}"), i + 2
    return "$", i + 1


# ----------------------------------------------------------------------------------------------------------------------
# ${...}


def _brace(v: Variables, body: str) -> str:
    if body.startswith("#") and NAME.fullmatch(body[1:]):  # ${#x}: the length
        text = v.scalar(body[1:])
        return str(len(text)) if MARK not in text else marker(body)
    m = NAME.match(body) or _SPECIAL.match(body)
    if not m:
        return marker(body)
    name, rest = m.group(), body[m.end():]
    if name in "@*":
        return ""  # the script's own arguments (${@:2} included): none here
    index = None
    im = _SUBSCRIPT.match(rest)
    if im:
        index, rest = im.group(1), rest[im.end():]
    return _operate(v, name, body, _subject(v, name, index), rest)


def _subject(v: Variables, name: str, index: Optional[str]) -> Value:
    """The value ${name[index]...} starts from (positional arguments are not known; $0 is the script)."""
    if name.isdigit():
        if name == "0" and v.script is not None:
            value: Value = str(v.script)
        else:
            value = Unknown(f"positional argument ${name}: the script's arguments are not known here")
    else:
        value = v.get(name)
    if isinstance(value, list):
        if index in ("@", "*"):
            value = " ".join(value)
        elif index is not None and index.isdigit():
            value = value[int(index)] if int(index) < len(value) else Unknown(f"{name}[{index}] is not set")
        else:
            value = value[0] if value else ""
    elif index is not None and index not in ("0", "@", "*") and not isinstance(value, Unknown):
        value = Unknown(f"{name}[{index}] is not set")
    if name == "BASH_SOURCE" and v.script is not None:
        value = str(v.script)
    return value


def _operate(v: Variables, name: str, body: str, value: Value, rest: str) -> str:
    """The operator after the name (`rest`): defaults, replacement, trims, or none."""
    unset = isinstance(value, Unknown)
    op = next((o for o in _DEFAULT_OPS if rest.startswith(o)), None)
    if op is not None:
        word = _expand_word(v, rest[len(op):])
        empty = unset or (op.startswith(":") and value == "")
        if op.endswith("+"):
            return "" if empty else word
        if op.endswith("?"):
            return v.text(name, value) if unset else marker(body)
        if empty:
            if op.endswith("=") and NAME.fullmatch(name):
                v.set(name, word)
            return word
        return value
    if rest.startswith("/"):
        return v.text(name, value) if unset else _replace(v, body, value, rest)
    if rest[:1] in ("#", "%") and not unset:
        return _trim(v, body, value, rest)
    if rest == "":
        return v.text(name, value)
    return v.text(name, value) if unset else marker(body)


def _replace(v: Variables, body: str, value: str, rest: str) -> str:
    """${x/old/new} (the first) and ${x//old/new} (every one); a glob pattern is not evaluated."""
    every = rest.startswith("//")
    pat, _, rep = rest[2 if every else 1:].partition("/")
    pat, rep = _expand_word(v, pat), _expand_word(v, rep)
    if any(ch in pat for ch in _GLOB):
        return marker(body)
    return value.replace(pat, rep) if every else value.replace(pat, rep, 1)


def _trim(v: Variables, body: str, value: str, rest: str) -> str:
    """${x#pre}, ${x%suf} and their longest forms; of the glob patterns only */ and /* (basename, dirname)."""
    longest = rest[:2] in ("##", "%%")
    pat = _expand_word(v, rest[2 if longest else 1:])
    if any(ch in pat for ch in _GLOB) and pat not in ("*/", "/*"):
        return marker(body)
    if pat == "*/":  # ${x##*/}: basename; ${x#*/}: after the first /
        return value.rsplit("/", 1)[-1] if longest else value.split("/", 1)[-1]
    if pat == "/*":  # ${x%/*}: dirname
        return value.rsplit("/", 1)[0] if not longest else value.split("/", 1)[0]
    if rest[0] == "#":
        return value[len(pat):] if value.startswith(pat) else value
    return value[:-len(pat)] if pat and value.endswith(pat) else value


# ----------------------------------------------------------------------------------------------------------------------
# $((...)) and $(...)


class _Unresolved(Exception):
    def __init__(self, name: str, why: str):
        self.name, self.why = name, why


def _arith(v: Variables, expr: str) -> str:
    text = _expand_dquoted(v, expr)
    if MARK in text:
        return text if is_marker(text) else marker(f"(({show(text).strip()}))")
    try:
        return str(arith_eval(text, v.get))
    except _Unresolved as exc:
        v.why.setdefault(exc.name, exc.why)
        return marker(exc.name)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError):
        return marker(f"(({expr.strip()}))")


def arith_eval(text: str, lookup: Callable[[str], Value], depth: int = 0) -> int:
    """bash's integer arithmetic on `text` (+ - * / % ** and signs); a variable's value is evaluated in turn."""
    if depth > 20:
        raise ValueError("recursion")

    def ev(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            value = lookup(node.id)
            if isinstance(value, Unknown):
                raise _Unresolved(node.id, value.why)
            if isinstance(value, list):  # bash reads an array as its first element, an empty one as ""
                value = value[0] if value else ""
            return arith_eval(value, lookup, depth + 1) if value != "" else 0
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp):
            result = _binary(node.op, ev(node.left), ev(node.right))
            if result is not None:
                return result
        raise ValueError(ast.dump(node))

    return ev(ast.parse(text.strip() or "0", mode="eval").body)


def _binary(op: ast.operator, a: int, b: int) -> Optional[int]:
    if isinstance(op, ast.Add):
        return a + b
    if isinstance(op, ast.Sub):
        return a - b
    if isinstance(op, ast.Mult):
        return a * b
    if isinstance(op, (ast.Div, ast.FloorDiv)):  # bash: integer division truncating toward zero
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    if isinstance(op, ast.Mod):
        r = abs(a) % abs(b)
        return r if a >= 0 else -r
    if isinstance(op, ast.Pow) and 0 <= b < 256:
        return a ** b
    return None


def _command_subst(v: Variables, inner: str) -> str:
    """$(...) for the pure commands pwd, dirname, basename, echo and `cd DIR && pwd`; anything else unresolved."""
    out = _pure_output(v, inner)
    if out is not None:
        return out
    name = "$(" + " ".join(inner.split()) + ")"
    v.why.setdefault(name, "a command substitution: the converter runs no commands")
    return marker(name)


def _pure_output(v: Variables, inner: str) -> Optional[str]:
    """What `inner` prints when it is one `&&` chain of pure commands; None otherwise."""
    try:
        items = parse(inner)
    except ShellParseError:
        return None
    if len(items) != 1:
        return None
    parts = items[0].parts
    cwd, out = v.cwd, None
    for k in range(0, len(parts), 2):
        if k and parts[k - 1] != "&&":
            return None
        args = _pure_args(v, parts[k])
        step = _pure_step(args[0], args[1:], cwd) if args else None
        if step is None:
            return None
        cwd, printed = step
        out = printed if printed is not None else out
    return out


def _pure_args(v: Variables, pipeline: list) -> Optional[list[str]]:
    """The expanded arguments of a one-command pipeline without assignments (None if not that, or unresolved)."""
    if len(pipeline) != 1 or not isinstance(pipeline[0], Simple) or pipeline[0].assigns:
        return None
    args = [a for w in pipeline[0].words for a in expand(v, w.raw) if a != "--"]
    return None if not args or any(MARK in a for a in args) else args


def _pure_step(cmd: str, rest: list[str], cwd: str) -> Optional[tuple[str, Optional[str]]]:
    """(the directory after it, what it prints or None) for a pure command; None for any other."""
    if cmd == "pwd" and not rest:
        return cwd, cwd
    if cmd == "cd" and len(rest) == 1:
        return resolve_dir(cwd, rest[0]), None
    if cmd == "dirname" and len(rest) == 1:
        return cwd, os.path.dirname(rest[0].rstrip("/")) or "."
    if cmd == "basename" and len(rest) in (1, 2):
        out = os.path.basename(rest[0].rstrip("/"))
        return cwd, out[:-len(rest[1])] if len(rest) == 2 and out.endswith(rest[1]) else out
    if cmd == "echo":
        return cwd, " ".join(rest)
    return None
