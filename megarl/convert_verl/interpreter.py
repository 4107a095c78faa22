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

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_MARK = "\x00"  # an unresolved expansion is kept as \x00name\x00 inside the text, so it survives word splitting
_MARKED = re.compile(r"\x00([^\x00]*)\x00")
_MODULE = re.compile(r"^(verl|recipe)\.[\w.]*main\w*$")
_REDIRECT_FD = re.compile(r"^\d+$")


class ShellParseError(ValueError):
    """The script could not be read to its end (an unterminated quote or block): nothing is converted."""


def marker(name: str) -> str:
    """The stand-in for an unresolved name (whitespace encoded, so that word splitting never cuts it)."""
    return _MARK + re.sub(r"[ \t\n]", chr(1), name) + _MARK


def _decode(name: str) -> str:
    return name.replace(chr(1), " ")


def unresolved_names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_decode(n) for n in _MARKED.findall(text)))


def show(text: str) -> str:
    """A marked text as the user wrote it: \x00name\x00 -> ${name} ($(cmd) and $1 as they are)."""
    return _MARKED.sub(lambda m: (_decode(m.group(1)) if m.group(1).startswith("$") else
                                  "${" + _decode(m.group(1)) + "}"), text)


# ----------------------------------------------------------------------------------------------------------------------
# Lexing: words (raw, quotes kept), operators, array assignments


@dataclass
class Word:
    raw: str


@dataclass
class Op:
    op: str


@dataclass
class ArrayAssign:
    name: str
    append: bool
    words: list[Word]


Token = Union[Word, Op, ArrayAssign]
_OPS = ("&&", "||", ";;", ";", "|", "&", "(", ")", "\n")


def _skip_quoted(text: str, i: int) -> int:
    """Index after the quoted/expansion construct starting at text[i] (', ", `, $( , ${ )."""
    c = text[i]
    if c == "'":
        j = text.find("'", i + 1)
        if j < 0:
            raise ShellParseError(f"unterminated single quote at offset {i}")
        return j + 1
    if c in '"`':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == c:
                return j + 1
            if c == '"' and text[j] == "$" and j + 1 < len(text) and text[j + 1] in "({":
                j = _skip_quoted(text, j)
                continue
            j += 1
        raise ShellParseError(f"unterminated {c} quote at offset {i}")
    if c == "$":
        open_, close = text[i + 1], ")" if text[i + 1] == "(" else "}"
        depth, j = 0, i + 1
        while j < len(text):
            ch = text[j]
            if ch == "\\":
                j += 2
                continue
            if ch in "'\"`":
                j = _skip_quoted(text, j)
                continue
            if ch == "$" and j + 1 < len(text) and text[j + 1] in "({" and j > i + 1:
                j = _skip_quoted(text, j)
                continue
            if ch == open_:
                depth += 1
            elif ch == close:
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        raise ShellParseError(f"unterminated ${open_} at offset {i}")
    raise AssertionError(c)


def lex(text: str) -> list[Token]:
    tokens: list[Token] = []
    i, n, word = 0, len(text), []
    redirect_next = False

    def end_word():
        nonlocal word, redirect_next
        if word:
            raw = "".join(word)
            word = []
            if redirect_next:
                redirect_next = False
            else:
                tokens.append(Word(raw))

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 == n:  # a continuation at the very end of the file continues into nothing
            break
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":  # line continuation
                i += 2
                continue
            word.append(text[i:i + 2])
            i += 2
            continue
        if c in "'\"`" or (c == "$" and i + 1 < n and text[i + 1] in "({"):
            j = _skip_quoted(text, i)
            word.append(text[i:j])
            i = j
            continue
        if c == "#" and not word:
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c in " \t\r":
            end_word()
            i += 1
            continue
        if c == "(" and word and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\+?=", "".join(word)):
            head = "".join(word)
            word = []
            depth, j = 1, i + 1
            while j < n and depth:
                ch = text[j]
                if ch == "\\":
                    j += 2
                    continue
                if ch in "'\"`" or (ch == "$" and j + 1 < n and text[j + 1] in "({"):
                    j = _skip_quoted(text, j)
                    continue
                if ch == "#" and (text[j - 1] in " \t\n("):
                    while j < n and text[j] != "\n":
                        j += 1
                    continue
                depth += ch == "("
                depth -= ch == ")"
                j += 1
            if depth:
                raise ShellParseError(f"unterminated array {head}( at offset {i}")
            inner = [t for t in lex(text[i + 1:j - 1]) if isinstance(t, Word)]
            tokens.append(ArrayAssign(head.rstrip("=").rstrip("+"), head.endswith("+="), inner))
            i = j
            continue
        if c in "<>":
            if word and _REDIRECT_FD.match("".join(word)):
                word = []
            end_word()
            j = i + 1
            while j < n and text[j] in "<>&":
                j += 1
            op = text[i:j]
            i = j
            if op.startswith("<<") and not op.startswith("<<<"):  # a here-document: its body is skipped
                m = re.match(r"-?[ \t]*(['\"]?)([A-Za-z_0-9]+)\1", text[i:])
                if not m:
                    raise ShellParseError(f"unreadable here-document at offset {i}")
                delim, strip_tabs = m.group(2), text[i:i + 1] == "-"
                i += m.end()
                line_end = text.find("\n", i)
                rest_of_line = text[i:line_end if line_end >= 0 else n]
                body_start = (line_end + 1) if line_end >= 0 else n
                k = body_start
                while True:
                    e = text.find("\n", k)
                    line = text[k:e if e >= 0 else n]
                    if (line.lstrip("\t") if strip_tabs else line) == delim:
                        break
                    if e < 0:
                        raise ShellParseError(f"here-document {delim} is not terminated")
                    k = e + 1
                text = text[:line_end if line_end >= 0 else n] + "\n" + text[(e + 1) if e >= 0 else n:]
                n = len(text)
                continue
            if op.endswith("&"):  # >&2, 2>&1: the target is a descriptor
                while i < n and text[i].isdigit():
                    i += 1
                if i < n and text[i] == "-":
                    i += 1
            else:
                redirect_next = True
            continue
        if c == "&" and i + 1 < n and text[i + 1] == ">":  # &> file
            end_word()
            i += 2
            redirect_next = True
            continue
        op = next((o for o in _OPS if text.startswith(o, i)), None)
        if op is not None:
            end_word()
            tokens.append(Op(op))
            i += len(op)
            continue
        word.append(c)
        i += 1
    end_word()
    return tokens


# ----------------------------------------------------------------------------------------------------------------------
# Parsing into commands


@dataclass
class Simple:
    assigns: list  # [(name, append, Word) | ArrayAssign]
    words: list[Word]


@dataclass
class AndOr:
    parts: list  # [command, op, command, ...] with op "&&" / "||"; a command is a pipeline: list of commands


@dataclass
class If:
    branches: list  # [(condition: list[AndOr] | None, body: list[AndOr])]


@dataclass
class For:
    var: str
    items: Optional[list[Word]]
    body: list


@dataclass
class Opaque:
    """A construct that is skipped (case, while, function bodies): variables assigned inside become unresolved."""
    what: str
    assigned: set


_RESERVED_END = {"then", "elif", "else", "fi", "do", "done", "esac", "}"}


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.t = tokens
        self.i = 0

    def peek(self) -> Optional[Token]:
        return self.t[self.i] if self.i < len(self.t) else None

    def peek_word(self) -> Optional[str]:
        tok = self.peek()
        return tok.raw if isinstance(tok, Word) else None

    def skip_separators(self) -> None:
        while isinstance(self.peek(), Op) and self.peek().op in ("\n", ";", "&"):
            self.i += 1

    def expect_word(self, *words: str) -> str:
        self.skip_separators()
        w = self.peek_word()
        if w not in words:
            raise ShellParseError(f"expected {' or '.join(words)}, found {w or self.peek()!r}")
        self.i += 1
        return w

    def parse_list(self, stop: set) -> list:
        items = []
        while True:
            self.skip_separators()
            tok = self.peek()
            if tok is None:
                if stop:
                    raise ShellParseError(f"the script ends inside a block (expected {' / '.join(sorted(stop))})")
                return items
            if isinstance(tok, Word) and tok.raw in stop:
                return items
            if isinstance(tok, Op) and tok.op == ")" and ")" in stop:
                return items
            items.append(self.parse_and_or())

    def parse_and_or(self) -> AndOr:
        parts = [self.parse_pipeline()]
        while isinstance(self.peek(), Op) and self.peek().op in ("&&", "||"):
            parts.append(self.peek().op)
            self.i += 1
            while isinstance(self.peek(), Op) and self.peek().op == "\n":
                self.i += 1
            parts.append(self.parse_pipeline())
        return AndOr(parts)

    def parse_pipeline(self) -> list:
        cmds = [self.parse_command()]
        while isinstance(self.peek(), Op) and self.peek().op == "|":
            self.i += 1
            while isinstance(self.peek(), Op) and self.peek().op == "\n":
                self.i += 1
            cmds.append(self.parse_command())
        return cmds

    def parse_command(self):
        w = self.peek_word()
        if w in ("!",):
            self.i += 1
            return self.parse_command()
        if w == "if":
            return self.parse_if()
        if w == "for":
            return self.parse_for()
        if w in ("while", "until"):
            self.i += 1
            self.parse_list({"do"})
            self.expect_word("do")
            body = self.parse_list({"done"})
            self.expect_word("done")
            return Opaque(w, _assigned(body))
        if w == "case":
            start = self.i
            depth = 0
            while self.i < len(self.t):
                tok = self.t[self.i]
                self.i += 1
                if isinstance(tok, Word) and tok.raw == "case":
                    depth += 1
                elif isinstance(tok, Word) and tok.raw == "esac":
                    depth -= 1
                    if depth == 0:
                        names = {m.group(1) for tok in self.t[start:self.i] if isinstance(tok, Word)
                                 for m in [_ASSIGN.match(tok.raw)] if m}
                        return Opaque("case", names)
            raise ShellParseError("the script ends inside a case block (expected esac)")
        if w in ("{",):
            self.i += 1
            body = self.parse_list({"}"})
            self.expect_word("}")
            return body
        if w == "function" or (w and isinstance(self._at(1), Op) and self._at(1).op == "("
                               and isinstance(self._at(2), Op) and self._at(2).op == ")"):
            self.i += 1 if w != "function" else 2
            if w != "function":
                self.i += 2
            elif isinstance(self.peek(), Op) and self.peek().op == "(":
                self.i += 2
            self.skip_separators()
            body = self.parse_command()
            return Opaque(f"function {w}", _assigned(body if isinstance(body, list) else [body]))
        if isinstance(self.peek(), Op) and self.peek().op == "(":
            self.i += 1
            body = self.parse_list({")"})
            if not (isinstance(self.peek(), Op) and self.peek().op == ")"):
                raise ShellParseError("unterminated ( subshell")
            self.i += 1
            return Opaque("subshell", _assigned(body))
        return self.parse_simple()

    def _at(self, k: int) -> Optional[Token]:
        return self.t[self.i + k] if self.i + k < len(self.t) else None

    def parse_if(self) -> If:
        self.i += 1
        branches = []
        cond = self.parse_list({"then"})
        self.expect_word("then")
        body = self.parse_list({"elif", "else", "fi"})
        branches.append((cond, body))
        while True:
            w = self.expect_word("elif", "else", "fi")
            if w == "fi":
                return If(branches)
            if w == "elif":
                cond = self.parse_list({"then"})
                self.expect_word("then")
                body = self.parse_list({"elif", "else", "fi"})
                branches.append((cond, body))
            else:
                body = self.parse_list({"fi"})
                branches.append((None, body))

    def parse_for(self) -> For:
        self.i += 1
        if isinstance(self.peek(), Op) and self.peek().op == "(":  # for ((i = 0; ...)): not unrolled
            depth = 0
            while self.i < len(self.t):
                tok = self.t[self.i]
                self.i += 1
                if isinstance(tok, Op) and tok.op in "()":
                    depth += 1 if tok.op == "(" else -1
                    if depth == 0:
                        break
            self.expect_word("do")
            body = self.parse_list({"done"})
            self.expect_word("done")
            return For("", None, body)
        var = self.peek_word() or ""
        self.i += 1
        items = None
        if self.peek_word() == "in":
            self.i += 1
            items = []
            while isinstance(self.peek(), Word):
                items.append(self.peek())
                self.i += 1
        self.expect_word("do")
        body = self.parse_list({"done"})
        self.expect_word("done")
        return For(var, items, body)

    def parse_simple(self) -> Simple:
        assigns, words = [], []
        while True:
            tok = self.peek()
            if tok is None or isinstance(tok, Op):
                break
            if isinstance(tok, ArrayAssign):
                if words:
                    words.append(Word(f"{tok.name}=(...)"))
                else:
                    assigns.append(tok)
                self.i += 1
                continue
            if not words and tok.raw in _RESERVED_END:
                break
            m = _ASSIGN.match(tok.raw)
            if m and not words:
                assigns.append((m.group(1), bool(m.group(2)), Word(tok.raw[m.end():])))
            else:
                words.append(tok)
            self.i += 1
        if not assigns and not words:
            tok = self.peek()
            raise ShellParseError(f"unexpected {tok.op if isinstance(tok, Op) else tok!r}")
        return Simple(assigns, words)


def _assigned(items) -> set:
    """Names a block could assign (to mark them unresolved when the block is not evaluated)."""
    names = set()
    for item in items if isinstance(items, list) else [items]:
        if isinstance(item, AndOr):
            for part in item.parts[::2]:
                for cmd in part:
                    names |= _assigned(cmd)
        elif isinstance(item, Simple):
            for a in item.assigns:
                names.add(a.name if isinstance(a, ArrayAssign) else a[0])
            if item.words and item.words[0].raw in ("export", "declare", "local", "readonly", "typeset"):
                for w in item.words[1:]:
                    m = _ASSIGN.match(w.raw)
                    if m:
                        names.add(m.group(1))
        elif isinstance(item, If):
            for cond, body in item.branches:
                names |= _assigned(body) | _assigned(cond or [])
        elif isinstance(item, For):
            names |= _assigned(item.body) | {item.var}
        elif isinstance(item, Opaque):
            names |= item.assigned
        elif isinstance(item, list):
            names |= _assigned(item)
    return names


# ----------------------------------------------------------------------------------------------------------------------
# Expansion


class _Unknown:
    """A variable whose value cannot be known (why is reported with the name)."""

    def __init__(self, why: str):
        self.why = why


Value = Union[str, list, _Unknown]


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
    def __init__(self, script: Optional[Path], environ: Optional[dict] = None, cwd: Optional[str] = None):
        self.script = script
        self.cwd = cwd or os.getcwd()
        base_env = dict(os.environ if environ is None else environ)
        base_env.setdefault("PWD", self.cwd)
        self.env: dict[str, Value] = dict(base_env)
        self.why: dict[str, str] = {}
        self.commands: list[tuple[list[str], bool]] = []  # verl command fields, found under an undecided condition
        self.uncertain = 0
        self.sourced: set = set()

    # -- values --------------------------------------------------------------------------------------------------------
    def get(self, name: str) -> Value:
        if name in self.env:
            return self.env[name]
        return _Unknown(self.why.get(name, "not set in the script or the environment"))

    def set(self, name: str, value: Value) -> None:
        if self.uncertain:
            old = self.env.get(name)
            if old != value:
                self.env[name] = _Unknown("assigned under a condition the converter cannot decide")
            return
        self.env[name] = value

    def scalar(self, name: str) -> str:
        v = self.get(name)
        if isinstance(v, _Unknown):
            self.why.setdefault(name, v.why)
            return marker(name)
        if isinstance(v, list):
            return v[0] if v else ""
        return v

    # -- word expansion ------------------------------------------------------------------------------------------------
    def expand(self, raw: str, split: bool = True) -> list[str]:
        """bash's expansion of one word: the fields it becomes (one, unless unquoted expansions split)."""
        fields: list[str] = []
        cur: list[str] = []
        have = False  # a field is started (quotes make an empty field)

        def add(text: str, splittable: bool):
            nonlocal cur, have
            if not splittable or not split:
                cur.append(text)
                have = True
                return
            parts = re.split(r"[ \t\n]+", text)
            for k, part in enumerate(parts):
                if k > 0:
                    if have or cur:
                        fields.append("".join(cur))
                    cur, have = [], False
                if part:
                    cur.append(part)
                    have = True

        i, n = 0, len(raw)
        while i < n:
            c = raw[i]
            if c == "\\" and i + 1 < n:
                add(raw[i + 1], False)
                i += 2
            elif c == "'":
                j = raw.index("'", i + 1)
                add(raw[i + 1:j], False)
                i = j + 1
            elif c == '"':
                j = _skip_quoted(raw, i)
                inner = raw[i + 1:j - 1]
                if re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\[[@*]\]\}", inner):  # "${ARR[@]}": one field each
                    v = self.get(inner[2:inner.index("[")])
                    items = v if isinstance(v, list) else [] if isinstance(v, _Unknown) else [v]
                    if isinstance(v, _Unknown):
                        items = [marker(inner[2:inner.index("[")])]
                        self.why.setdefault(inner[2:inner.index("[")], v.why)
                    for k, item in enumerate(items):
                        if k > 0:
                            fields.append("".join(cur))
                            cur = []
                        cur.append(item)
                        have = True
                    i = j
                    continue
                add(self._expand_dquoted(inner), False)
                have = True
                i = j
            elif c == "$":
                text, j = self._dollar(raw, i)
                add(text, True)
                i = j
            elif c == "`":
                j = _skip_quoted(raw, i)
                add(self._command_subst(raw[i + 1:j - 1]), True)
                i = j
            else:
                add(c, False)
                i += 1
        if have or cur:
            fields.append("".join(cur))
        return fields

    def _expand_dquoted(self, inner: str) -> str:
        out, i, n = [], 0, len(inner)
        while i < n:
            c = inner[i]
            if c == "\\" and i + 1 < n and inner[i + 1] in '$`"\\\n':
                out.append("" if inner[i + 1] == "\n" else inner[i + 1])
                i += 2
            elif c == "$":
                text, i = self._dollar(inner, i)
                out.append(text)
            elif c == "`":
                j = _skip_quoted(inner, i)
                out.append(self._command_subst(inner[i + 1:j - 1]))
                i = j
            else:
                out.append(c)
                i += 1
        return "".join(out)

    def _dollar(self, s: str, i: int) -> tuple[str, int]:
        """Expand the $-construct at s[i]; return its text and the index after it."""
        n = len(s)
        if i + 1 >= n:
            return "$", i + 1
        c = s[i + 1]
        if s.startswith("$((", i):
            j = _skip_quoted(s, i)
            return self.arith(s[i + 3:j - 2]), j
        if c == "(":
            j = _skip_quoted(s, i)
            return self._command_subst(s[i + 2:j - 1]), j
        if c == "{":
            j = _skip_quoted(s, i)
            return self._brace(s[i + 2:j - 1]), j
        m = _NAME.match(s, i + 1)
        if m:
            return self.scalar(m.group()), m.end()
        if c in "@*":
            return "", i + 2  # the arguments the script was started with: none here
        if c == "#":
            return "0", i + 2
        if c.isdigit():
            if c == "0" and self.script is not None:
                return str(self.script), i + 2
            return marker(f"${c}"), i + 2
        if c in "?$!-":
            return marker(f"${c}"), i + 2
        return "$", i + 1

    def _brace(self, body: str) -> str:
        if body.startswith("#") and _NAME.fullmatch(body[1:]):
            v = self.scalar(body[1:])
            return str(len(v)) if _MARK not in v else marker(body)
        m = _NAME.match(body) or re.match(r"\d+|[@*#?]", body)
        if not m:
            return marker(body)
        name, rest = m.group(), body[m.end():]
        index = None
        im = re.match(r"\[([^\]]*)\]", rest)
        if im:
            index, rest = im.group(1), rest[im.end():]
        if name.isdigit():
            if name == "0" and self.script is not None:
                value: Value = str(self.script)
            else:
                value = _Unknown(f"positional argument ${name}: the script's arguments are not known here")
        elif name in "@*":
            return ""  # the script's own arguments (${@:2} included): none here
        else:
            value = self.get(name)
        if isinstance(value, list):
            if index in ("@", "*"):
                value = " ".join(value)
            elif index is not None and index.isdigit():
                value = value[int(index)] if int(index) < len(value) else _Unknown(f"{name}[{index}] is not set")
            else:
                value = value[0] if value else ""
        elif index is not None and index not in ("0", "@", "*") and not isinstance(value, _Unknown):
            value = _Unknown(f"{name}[{index}] is not set")
        if name == "BASH_SOURCE" and self.script is not None:
            value = str(self.script)
        unset = isinstance(value, _Unknown)
        for op in (":-", ":=", ":+", ":?", "-", "=", "+", "?"):
            if rest.startswith(op):
                word = self._expand_dquoted_word(rest[len(op):])
                colon = op.startswith(":")
                empty = unset or (colon and value == "")
                if op.endswith("+"):
                    return "" if empty or unset else word
                if op.endswith("?"):
                    break
                if unset or (colon and value == ""):
                    if op.endswith("=") and _NAME.fullmatch(name):
                        self.set(name, word)
                    return word
                return value
        else:
            if rest.startswith(("//", "/")):
                every = rest.startswith("//")
                pat, _, rep = rest[2 if every else 1:].partition("/")
                if unset:
                    return self._unknown_text(name, value)
                pat, rep = self._expand_dquoted_word(pat), self._expand_dquoted_word(rep)
                if any(ch in pat for ch in "*?["):
                    return marker(body)
                return value.replace(pat, rep) if every else value.replace(pat, rep, 1)
            if rest[:1] in ("#", "%") and not unset:
                longest = rest[:2] in ("##", "%%")
                pat = self._expand_dquoted_word(rest[2 if longest else 1:])
                if any(ch in pat for ch in "*?[") and pat not in ("*/", "/*"):
                    return marker(body)
                if pat == "*/":  # ${x##*/}: basename; ${x#*/}: after the first /
                    return value.rsplit("/", 1)[-1] if longest else value.split("/", 1)[-1]
                if pat == "/*":  # ${x%/*}: dirname
                    return value.rsplit("/", 1)[0] if not longest else value.split("/", 1)[0]
                if rest[0] == "#":
                    return value[len(pat):] if value.startswith(pat) else value
                return value[:-len(pat)] if pat and value.endswith(pat) else value
            if rest == "":
                return self._unknown_text(name, value) if unset else value
        return self._unknown_text(name, value) if unset else marker(body)

    def _unknown_text(self, name: str, value: _Unknown) -> str:
        self.why.setdefault(name, value.why)
        return marker(name)

    def _expand_dquoted_word(self, text: str) -> str:
        """The word of ${x:-word}: quotes removed, expansions made (no splitting)."""
        return "".join(self.expand(text, split=False)) if text else ""

    def arith(self, expr: str) -> str:
        text = self._expand_dquoted(expr)
        if _MARK in text:
            return text if _MARKED.fullmatch(text) else marker(f"(({show(text).strip()}))")
        try:
            return str(self._arith_eval(text, 0))
        except _Unresolved as exc:
            self.why.setdefault(exc.name, exc.why)
            return marker(exc.name)
        except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError):
            return marker(f"(({expr.strip()}))")

    def _arith_eval(self, text: str, depth: int) -> int:
        if depth > 20:
            raise ValueError("recursion")
        tree = ast.parse(text.strip() or "0", mode="eval").body

        def ev(node) -> int:
            if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
                return node.value
            if isinstance(node, ast.Name):
                v = self.get(node.id)
                if isinstance(v, _Unknown):
                    raise _Unresolved(node.id, v.why)
                v = v[0] if isinstance(v, list) and v else v
                return self._arith_eval(v, depth + 1) if v != "" else 0
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
                return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
            if isinstance(node, ast.BinOp):
                a, b = ev(node.left), ev(node.right)
                op = node.op
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
                if isinstance(op, ast.Pow) and b >= 0 and b < 256:
                    return a ** b
            raise ValueError(ast.dump(node))

        return ev(tree)

    def _command_subst(self, inner: str) -> str:
        """$(...) for the pure commands pwd, dirname, basename, echo and `cd DIR && pwd`; anything else unresolved."""
        try:
            items = _Parser(lex(inner)).parse_list(set())
        except ShellParseError:
            items = None
        cwd, out = self.cwd, None
        if items and len(items) == 1:
            parts = items[0].parts
            ok = True
            for k in range(0, len(parts), 2):
                if k and parts[k - 1] != "&&":
                    ok = False
                    break
                pipeline = parts[k]
                if len(pipeline) != 1 or not isinstance(pipeline[0], Simple) or pipeline[0].assigns:
                    ok = False
                    break
                args = [f for w in pipeline[0].words for f in self.expand(w.raw)]
                args = [a for a in args if a != "--"]
                if not args or any(_MARK in a for a in args):
                    ok = False
                    break
                cmd, rest = args[0], args[1:]
                if cmd == "pwd" and not rest:
                    out = cwd
                elif cmd == "cd" and len(rest) == 1:
                    cwd = os.path.normpath(os.path.join(cwd, os.path.expanduser(rest[0])))
                elif cmd == "dirname" and len(rest) == 1:
                    out = os.path.dirname(rest[0].rstrip("/")) or "."
                elif cmd == "basename" and len(rest) in (1, 2):
                    out = os.path.basename(rest[0].rstrip("/"))
                    if len(rest) == 2 and out.endswith(rest[1]):
                        out = out[:-len(rest[1])]
                elif cmd == "echo":
                    out = " ".join(rest)
                else:
                    ok = False
                    break
            if ok and out is not None:
                return out
        name = "$(" + " ".join(inner.split()) + ")"
        self.why.setdefault(name, "a command substitution: the converter runs no commands")
        return marker(name)

    # -- execution -----------------------------------------------------------------------------------------------------
    def run(self, items: list) -> Optional[bool]:
        status: Optional[bool] = True
        for item in items:
            status = self.run_item(item)
        return status

    def run_item(self, item) -> Optional[bool]:
        if isinstance(item, AndOr):
            status = self.run_pipeline(item.parts[0])
            for k in range(1, len(item.parts), 2):
                op, nxt = item.parts[k], item.parts[k + 1]
                if status is None:  # undecided: the rest may or may not run
                    self.uncertain += 1
                    try:
                        self.run_pipeline(nxt)
                    finally:
                        self.uncertain -= 1
                    status = None
                elif (op == "&&") == status:
                    status = self.run_pipeline(nxt)
            return status
        if isinstance(item, list):
            return self.run(item)
        if isinstance(item, If):
            return self.run_if(item)
        if isinstance(item, For):
            values = None
            if item.items is not None:
                values = [f for w in item.items for f in self.expand(w.raw)]
            if values is None or any(_MARK in v for v in values):
                for name in (_assigned(item.body) | {item.var}) - {""}:
                    self.env[name] = _Unknown("assigned in a for loop the converter cannot unroll")
                return None
            for v in values:
                self.set(item.var, v)
                self.run(item.body)
            return True
        if isinstance(item, Opaque):
            for name in item.assigned:
                self.env[name] = _Unknown(f"assigned inside a {item.what} block the converter does not evaluate")
            return None
        if isinstance(item, Simple):
            return self.run_simple(item)
        raise AssertionError(item)

    def run_pipeline(self, pipeline: list) -> Optional[bool]:
        status = None
        for k, cmd in enumerate(pipeline):
            status = self.run_item(cmd) if not isinstance(cmd, list) else self.run(cmd)
        return status if len(pipeline) == 1 else True

    def run_if(self, node: If) -> Optional[bool]:
        undecided = 0
        for cond, body in node.branches:
            decided = True if cond is None else self.run(cond)
            if decided is None:
                undecided += 1
                self.uncertain += 1
                try:
                    self.run(body)
                finally:
                    self.uncertain -= 1
                continue
            if decided:
                if undecided:
                    self.uncertain += 1
                try:
                    self.run(body)
                finally:
                    if undecided:
                        self.uncertain -= 1
                return True
        return True

    def run_simple(self, cmd: Simple) -> Optional[bool]:
        for a in cmd.assigns if not cmd.words else []:
            self._assign(a)
        if not cmd.words:
            return True
        args = [f for w in cmd.words for f in self.expand(w.raw)]
        if not args:
            return True
        name = args[0]
        if name in ("export", "declare", "local", "readonly", "typeset"):
            for raw in cmd.words[1:]:
                m = _ASSIGN.match(raw.raw)
                if m:
                    self._assign((m.group(1), bool(m.group(2)), Word(raw.raw[m.end():])))
            return True
        if name == "unset":
            for a in args[1:]:
                if not a.startswith("-"):
                    self.env.pop(a, None)
            return True
        if name in ("[", "[[", "test"):
            return self.test(args)
        if name in ("true", ":"):
            return True
        if name == "false":
            return False
        if name == "exit":
            if self.uncertain:
                return None
            raise _Exit()
        if name in ("source", "."):
            return self.source(args[1:])
        if name == "cd" and len(args) == 2 and _MARK not in args[1] and not self.uncertain:
            self.cwd = os.path.normpath(os.path.join(self.cwd, os.path.expanduser(args[1])))
            self.env["PWD"] = self.cwd
            return True
        for k, a in enumerate(args[:-1]):
            if a == "-m" and _MODULE.match(args[k + 1]):
                self.commands.append((args[k + 1:], bool(self.uncertain)))
                return True
        for k, a in enumerate(args):
            if re.search(r"(^|/)(verl|recipe)/[\w/]*main_\w+\.py$", a):
                self.commands.append((args[k:], bool(self.uncertain)))
                return True
        if name in ("set", "echo", "printf", "ulimit", "mkdir", "shift", "trap", "wait", "sleep", "pip", "pip3"):
            return True
        return True  # other commands are not run; assume they succeed

    def _assign(self, a) -> None:
        if isinstance(a, ArrayAssign):
            items = [f for w in a.words for f in self.expand(w.raw)]
            old = self.env.get(a.name) if a.append else None
            base = old if isinstance(old, list) else ([old] if isinstance(old, str) else [])
            self.set(a.name, base + items)
            return
        name, append, word = a
        value = "".join(self.expand(word.raw, split=False))
        if append:
            old = self.get(name)
            if isinstance(old, list):
                self.set(name, old + [value])
                return
            value = (marker(name) if isinstance(old, _Unknown) else old) + value
        self.set(name, value)

    def test(self, args: list[str]) -> Optional[bool]:
        end = {"[": "]", "[[": "]]"}.get(args[0])
        body = args[1:-1] if end and args[-1:] == [end] else args[1:]
        if any(x in body for x in ("&&", "||", "-a", "-o", "!", "(", ")")):
            return None
        if any(_MARK in x for x in body):
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
            p = Path(self.cwd, os.path.expanduser(body[1]))
            return {"-f": p.is_file, "-d": p.is_dir, "-e": p.exists}[body[0]]()
        if len(body) == 1:
            return body[0] != ""
        return None

    def source(self, args: list[str]) -> Optional[bool]:
        if not args or _MARK in args[0]:
            return None
        path = Path(self.cwd, os.path.expanduser(args[0]))
        if not path.is_file() or path.resolve() in self.sourced:
            return None if not path.is_file() else True
        self.sourced.add(path.resolve())
        self.run(_Parser(lex(path.read_text())).parse_list(set()))
        return True


class _Unresolved(Exception):
    def __init__(self, name: str, why: str):
        self.name, self.why = name, why


def read_script(path: Path, environ: Optional[dict] = None, cwd: Optional[str] = None) -> ScriptRead:
    """The verl command of a launch script, its words expanded as bash would (see the module docstring).

    Raises ShellParseError when the script cannot be read to its end or runs no verl command."""
    text = path.read_text()
    interp = Interpreter(path, environ, cwd)
    items = _Parser(lex(text)).parse_list(set())
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
    args = fields[1:]
    k = 0
    while k < len(args):
        arg = args[k]
        flag = next((f for f in ("--config-path", "--config-name", "-cp", "-cn") if arg == f or
                     arg.startswith(f + "=")), None)
        if flag:
            if arg == flag:
                value = args[k + 1] if k + 1 < len(args) else ""
                k += 1
            else:
                value = arg[len(flag) + 1:]
            if _MARK in value:
                read.unresolved.append((f"{flag}={show(value)}", unresolved_names(value), _why(interp, value)))
            elif flag in ("--config-path", "-cp"):
                read.config_path = value
            else:
                read.config_name = value
        elif _MARK in arg:
            read.unresolved.append((show(arg), unresolved_names(arg), _why(interp, arg)))
        elif arg:
            read.overrides.append(arg)
        k += 1
    return read


def _why(interp: Interpreter, text: str) -> str:
    return "; ".join(f"{show(marker(n))}: {interp.why.get(n, 'not set in the script or the environment')}"
                     for n in unresolved_names(text))
