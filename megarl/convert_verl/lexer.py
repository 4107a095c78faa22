"""Shell words and quoting: a launch script's text -> words (quotes and expansions kept raw), operators and array
assignments, the way bash splits a line before it expands anything.

Line continuations join lines, comments go, redirections and their targets go (a here-document's body with them), and a
quoted or `$(...)`/`${...}` construct stays inside its word whatever it contains. Nothing is expanded here: a word keeps
its quotes for the expansion to read (megarl.convert_verl.expansion).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

_REDIRECT_FD = re.compile(r"^\d+$")
_ARRAY_HEAD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+?=")
_HEREDOC_DELIMITER = re.compile(r"-?[ \t]*(['\"]?)([A-Za-z_0-9]+)\1")
_OPS = ("&&", "||", ";;", ";", "|", "&", "(", ")", "\n")


class ShellParseError(ValueError):
    """The script could not be read to its end (an unterminated quote or block): nothing is converted."""


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


def opens_construct(text: str, i: int) -> bool:
    """Whether text[i] starts a quote or a `$(`/`${` construct (which skip_quoted steps over whole)."""
    c = text[i]
    return c in "'\"`" or (c == "$" and i + 1 < len(text) and text[i + 1] in "({")


def _skip_single(text: str, i: int) -> int:
    j = text.find("'", i + 1)
    if j < 0:
        raise ShellParseError(f"unterminated single quote at offset {i}")
    return j + 1


def _skip_double(text: str, i: int) -> int:
    """After the "..." or `...` at text[i]: backslashes escape, and inside "..." a $( or ${ is stepped over whole."""
    c, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == c:
            return j + 1
        if c == '"' and text[j] == "$" and j + 1 < len(text) and text[j + 1] in "({":
            j = skip_quoted(text, j)
            continue
        j += 1
    raise ShellParseError(f"unterminated {c} quote at offset {i}")


def _skip_expansion(text: str, i: int) -> int:
    """After the $( ... ) or ${ ... } at text[i], nested quotes and expansions included."""
    open_, close = text[i + 1], ")" if text[i + 1] == "(" else "}"
    depth, j = 0, i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch in "'\"`":
            j = skip_quoted(text, j)
            continue
        if ch == "$" and j + 1 < len(text) and text[j + 1] in "({" and j > i + 1:
            j = skip_quoted(text, j)
            continue
        if ch == open_:
            depth += 1
        elif ch == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ShellParseError(f"unterminated ${open_} at offset {i}")


def skip_quoted(text: str, i: int) -> int:
    """Index after the quoted/expansion construct starting at text[i] (', ", `, $( , ${ )."""
    c = text[i]
    if c == "'":
        return _skip_single(text, i)
    if c in '"`':
        return _skip_double(text, i)
    if c == "$":
        return _skip_expansion(text, i)
    raise AssertionError(c)



def _line_end(text: str, i: int) -> int:
    j = text.find("\n", i)
    return len(text) if j < 0 else j


def _array_end(text: str, i: int, head: str) -> int:
    """Index after the `)` closing the array body whose `(` is text[i] (comments and quotes inside skipped)."""
    n, depth, j = len(text), 1, i + 1
    while j < n and depth:
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if opens_construct(text, j):
            j = skip_quoted(text, j)
            continue
        if ch == "#" and (text[j - 1] in " \t\n("):
            j = _line_end(text, j)
            continue
        depth += ch == "("
        depth -= ch == ")"
        j += 1
    if depth:
        raise ShellParseError(f"unterminated array {head}( at offset {i}")
    return j


def _cut_heredoc(text: str, i: int) -> tuple[str, int]:
    """The text without the here-document whose delimiter word starts at text[i] (after `<<`), and the index after
    that word: the rest of its line is still read, its body is not."""
    m = _HEREDOC_DELIMITER.match(text[i:])
    if not m:
        raise ShellParseError(f"unreadable here-document at offset {i}")
    delim, strip_tabs = m.group(2), text[i:i + 1] == "-"
    i += m.end()
    n = len(text)
    line_end = text.find("\n", i)
    k = (line_end + 1) if line_end >= 0 else n
    while True:
        e = text.find("\n", k)
        line = text[k:e if e >= 0 else n]
        if (line.lstrip("\t") if strip_tabs else line) == delim:
            break
        if e < 0:
            raise ShellParseError(f"here-document {delim} is not terminated")
        k = e + 1
    return text[:line_end if line_end >= 0 else n] + "\n" + text[(e + 1) if e >= 0 else n:], i


class _Lexer:
    """One pass over a script's text; `word` collects the characters of the word being read."""

    def __init__(self, text: str):
        self.text, self.i = text, 0
        self.word: list[str] = []
        self.tokens: list[Token] = []
        self.redirect_next = False  # the next word is a redirection's target: dropped

    def run(self) -> list[Token]:
        while self.i < len(self.text) and self.step():
            pass
        self.end_word()
        return self.tokens

    def end_word(self) -> None:
        if self.word:
            raw = "".join(self.word)
            self.word = []
            if self.redirect_next:
                self.redirect_next = False
            else:
                self.tokens.append(Word(raw))

    def step(self) -> bool:
        """Read what starts at self.i; False at a continuation into the end of the file (nothing follows)."""
        text, i = self.text, self.i
        c = text[i]
        if c == "\\":
            if i + 1 == len(text):
                return False
            if text[i + 1] != "\n":  # a backslash-newline joins lines
                self.word.append(text[i:i + 2])
            self.i = i + 2
        elif opens_construct(text, i):
            self.i = skip_quoted(text, i)
            self.word.append(text[i:self.i])
        elif c == "#" and not self.word:
            self.i = _line_end(text, i)
        elif c in " \t\r":
            self.end_word()
            self.i = i + 1
        elif c == "(" and self.word and _ARRAY_HEAD.fullmatch("".join(self.word)):
            self.array()
        elif c in "<>":
            self.redirect()
        elif c == "&" and text.startswith("&>", i):
            self.end_word()
            self.i = i + 2
            self.redirect_next = True
        else:
            self.operator_or_char()
        return True

    def operator_or_char(self) -> None:
        op = next((o for o in _OPS if self.text.startswith(o, self.i)), None)
        if op is None:
            self.word.append(self.text[self.i])
            self.i += 1
            return
        self.end_word()
        self.tokens.append(Op(op))
        self.i += len(op)

    def array(self) -> None:
        """NAME=( ... ) or NAME+=( ... ): the words between the parentheses, lexed on their own."""
        head, self.word = "".join(self.word), []
        j = _array_end(self.text, self.i, head)
        inner = [t for t in lex(self.text[self.i + 1:j - 1]) if isinstance(t, Word)]
        self.tokens.append(ArrayAssign(head.rstrip("=").rstrip("+"), head.endswith("+="), inner))
        self.i = j

    def redirect(self) -> None:
        """<, >, >>, 2>&1, <<EOF ...: the operator goes, and so does a file target (the next word)."""
        if self.word and _REDIRECT_FD.match("".join(self.word)):
            self.word = []
        self.end_word()
        text, j = self.text, self.i + 1
        while j < len(text) and text[j] in "<>&":
            j += 1
        op, self.i = text[self.i:j], j
        if op.startswith("<<") and not op.startswith("<<<"):
            self.text, self.i = _cut_heredoc(text, j)
        elif op.endswith("&"):  # >&2, 2>&1: the target is a descriptor
            while self.i < len(text) and text[self.i].isdigit():
                self.i += 1
            if self.i < len(text) and text[self.i] == "-":
                self.i += 1
        else:
            self.redirect_next = True


def lex(text: str) -> list[Token]:
    """A script's text -> its tokens (see the module docstring)."""
    return _Lexer(text).run()
