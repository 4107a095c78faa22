"""Shell commands from tokens: simple commands with their assignments, `&&`/`||` chains, pipelines, `if` and `for`
blocks, and the constructs that are not evaluated (case, while, functions, subshells) with the names they could assign.

`parse(text)` is the whole script as a list of `AndOr` chains; megarl.convert_verl.interpreter runs them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megarl.convert_verl.lexer import ArrayAssign, Op, ShellParseError, Token, Word, lex

_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
DECLARES = ("export", "declare", "local", "readonly", "typeset")  # builtins whose NAME=value words assign
_RESERVED_END = {"then", "elif", "else", "fi", "do", "done", "esac", "}"}


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


def assignment(raw: str) -> Optional[tuple[str, bool, Word]]:
    """NAME=value or NAME+=value as (name, append, the value's raw word); None for any other word."""
    m = _ASSIGN.match(raw)
    return (m.group(1), bool(m.group(2)), Word(raw[m.end():])) if m else None


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.t = tokens
        self.i = 0

    def peek(self) -> Optional[Token]:
        return self.t[self.i] if self.i < len(self.t) else None

    def peek_word(self) -> Optional[str]:
        tok = self.peek()
        return tok.raw if isinstance(tok, Word) else None

    def op_at(self, k: int, *ops: str) -> bool:
        """Whether the token k after the current one is one of the operators `ops`."""
        tok = self.t[self.i + k] if self.i + k < len(self.t) else None
        return isinstance(tok, Op) and tok.op in ops

    def skip_ops(self, *ops: str) -> None:
        while self.op_at(0, *ops):
            self.i += 1

    def skip_separators(self) -> None:
        self.skip_ops("\n", ";", "&")

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
        while self.op_at(0, "&&", "||"):
            parts.append(self.peek().op)
            self.i += 1
            self.skip_ops("\n")
            parts.append(self.parse_pipeline())
        return AndOr(parts)

    def parse_pipeline(self) -> list:
        cmds = [self.parse_command()]
        while self.op_at(0, "|"):
            self.i += 1
            self.skip_ops("\n")
            cmds.append(self.parse_command())
        return cmds

    def parse_command(self):
        w = self.peek_word()
        if w == "!":
            self.i += 1
            return self.parse_command()
        if w in ("if", "for", "while", "until", "case", "{", "function"):
            return {"if": self.parse_if, "for": self.parse_for, "while": self.parse_loop, "until": self.parse_loop,
                    "case": self.parse_case, "{": self.parse_group, "function": self.parse_function}[w]()
        if w and self.op_at(1, "(") and self.op_at(2, ")"):
            return self.parse_function()
        if self.op_at(0, "("):
            return self.parse_subshell()
        return self.parse_simple()

    def parse_block(self, keyword: str, end: str) -> list:
        """`keyword ... end` (do ... done, then ... fi): the list between them."""
        self.expect_word(keyword)
        body = self.parse_list({end})
        self.expect_word(end)
        return body

    def parse_loop(self) -> Opaque:
        w = self.peek_word()
        self.i += 1
        self.parse_list({"do"})
        return Opaque(w, assigned(self.parse_block("do", "done")))

    def parse_case(self) -> Opaque:
        start, depth = self.i, 0
        while self.i < len(self.t):
            tok = self.t[self.i]
            self.i += 1
            if isinstance(tok, Word) and tok.raw == "case":
                depth += 1
            elif isinstance(tok, Word) and tok.raw == "esac":
                depth -= 1
                if depth == 0:
                    return Opaque("case", {a[0] for tok in self.t[start:self.i] if isinstance(tok, Word)
                                           for a in [assignment(tok.raw)] if a})
        raise ShellParseError("the script ends inside a case block (expected esac)")

    def parse_group(self) -> list:
        self.i += 1
        body = self.parse_list({"}"})
        self.expect_word("}")
        return body

    def parse_function(self) -> Opaque:
        """`function NAME [()] BODY` or `NAME() BODY`: not run; the names its body assigns become unresolved."""
        w = self.peek_word()
        if w != "function":
            self.i += 3
        else:
            self.i += 2
            if self.op_at(0, "("):
                self.i += 2
        self.skip_separators()
        body = self.parse_command()
        return Opaque(f"function {w}", assigned(body if isinstance(body, list) else [body]))

    def parse_subshell(self) -> Opaque:
        self.i += 1
        body = self.parse_list({")"})
        if not self.op_at(0, ")"):
            raise ShellParseError("unterminated ( subshell")
        self.i += 1
        return Opaque("subshell", assigned(body))

    def parse_if(self) -> If:
        self.i += 1
        branches = [self.parse_branch()]
        while True:
            w = self.expect_word("elif", "else", "fi")
            if w == "fi":
                return If(branches)
            branches.append(self.parse_branch() if w == "elif" else (None, self.parse_list({"fi"})))

    def parse_branch(self) -> tuple[list, list]:
        """`COND; then BODY` of an if or elif, up to the elif, else or fi that follows."""
        cond = self.parse_list({"then"})
        self.expect_word("then")
        return cond, self.parse_list({"elif", "else", "fi"})

    def parse_for(self) -> For:
        self.i += 1
        if self.op_at(0, "("):  # for ((i = 0; ...)): not unrolled
            self.skip_arithmetic_header()
            return For("", None, self.parse_block("do", "done"))
        var = self.peek_word() or ""
        self.i += 1
        items = None
        if self.peek_word() == "in":
            self.i += 1
            items = []
            while isinstance(self.peek(), Word):
                items.append(self.peek())
                self.i += 1
        return For(var, items, self.parse_block("do", "done"))

    def skip_arithmetic_header(self) -> None:
        depth = 0
        while self.i < len(self.t):
            tok = self.t[self.i]
            self.i += 1
            if isinstance(tok, Op) and tok.op in ("(", ")"):
                depth += 1 if tok.op == "(" else -1
                if depth == 0:
                    return

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
            a = assignment(tok.raw)
            if a and not words:
                assigns.append(a)
            else:
                words.append(tok)
            self.i += 1
        if not assigns and not words:
            tok = self.peek()
            raise ShellParseError(f"unexpected {tok.op if isinstance(tok, Op) else tok!r}")
        return Simple(assigns, words)


def parse(text: str) -> list:
    """A script's text -> its commands (a list of AndOr chains); ShellParseError when it cannot be read to its end."""
    return _Parser(lex(text)).parse_list(set())


def assigned(items) -> set:
    """Names a block could assign (to mark them unresolved when the block is not evaluated)."""
    names = set()
    for item in items if isinstance(items, list) else [items]:
        if isinstance(item, AndOr):
            for part in item.parts[::2]:
                for cmd in part:
                    names |= assigned(cmd)
        elif isinstance(item, Simple):
            names |= _simple_assigned(item)
        elif isinstance(item, If):
            for cond, body in item.branches:
                names |= assigned(body) | assigned(cond or [])
        elif isinstance(item, For):
            names |= assigned(item.body) | {item.var}
        elif isinstance(item, Opaque):
            names |= item.assigned
        elif isinstance(item, list):
            names |= assigned(item)
    return names


def _simple_assigned(cmd: Simple) -> set:
    names = {a.name if isinstance(a, ArrayAssign) else a[0] for a in cmd.assigns}
    if cmd.words and cmd.words[0].raw in DECLARES:
        names |= {a[0] for w in cmd.words[1:] for a in [assignment(w.raw)] if a}
    return names
