"""Tool calls in a model turn's text, in the format of rollout.multi_turn.format.

hermes (Qwen2.5, Hermes, NousResearch templates): each call is
    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>
with whitespace allowed around the JSON; "arguments" may also be a JSON string holding the object.
"""
from __future__ import annotations

import json
import re

from megarl.agent.tools import ToolCall

FORMATS = ("hermes",)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> of `text` in order; a body that is not a call becomes a ToolCall with error
    ("parse", why). An opening tag without its closing tag is a parse error too (the model meant to call)."""
    calls = []
    for body in _HERMES.findall(text):
        calls.append(_hermes_call(body.strip()))
    if text.count("<tool_call>") > len(calls):
        calls.append(ToolCall(None, error=("parse", "a <tool_call> without its closing </tool_call>")))
    return calls


def _hermes_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall(None, error=("parse", f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error=("parse", 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'))
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return ToolCall(obj["name"], error=("parse", "the arguments string is not valid JSON"))
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=("bad_arguments", "arguments must be a JSON object"))
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    if fmt == "hermes":
        return parse_hermes(text)
    raise ValueError(f"tool call format {fmt!r}: expected one of {FORMATS}")
