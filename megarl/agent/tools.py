"""Tools a model may call during a multi-turn rollout: declared in YAML, backed by Python or HTTP.

Tool config (rollout.multi_turn.tool_config_path):

    tools:
      - function: tools/calculator.py:calculator     # a Python function (sync: run in a thread; or async) or class
        timeout_s: 5                                 # per call; the model gets an error response when it is exceeded
        schema:                                      # the OpenAI function schema the model is shown
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression.
            parameters:
              type: object
              properties: {expression: {type: string}}
              required: [expression]
      - url: http://localhost:8000/search            # an HTTP endpoint: POST {"name", "arguments", "trajectory_id"}
        schema: {...}

A Python tool named by a *class* is stateful: one instance per trajectory, created at the trajectory's first call
(`create(extra_info)` if defined), called through `execute(**arguments)` (sync or async), released at the end of the
trajectory (`release()` if defined). A tool returns a str (or a number), or a dict {"text": str, "reward": float}:
rewards of a trajectory's calls are summed into its reward. An HTTP tool answers with a JSON object of the same form,
or plain text.

Bad input never stops a run: every failure becomes the tool's response text ("Error: ..."), counted by kind
(ERROR_KINDS) in the rollout's tool/errors/<kind> metrics.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "too_many_calls", "exception", "timeout", "http",
               "bad_return")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


class ToolConfigError(ValueError):
    """The tool config cannot be used; the message names the file, the tool and what to fix."""


@dataclass
class ToolResult:
    text: str
    reward: float = 0.0
    error: Optional[str] = None  # one of ERROR_KINDS, None on success


@dataclass
class ToolCall:
    """One call parsed from the model's text; `error` set (kind, message) when it could not be parsed."""

    name: Optional[str]
    arguments: dict = field(default_factory=dict)
    error: Optional[tuple[str, str]] = None


@dataclass
class Tool:
    name: str
    schema: dict  # the OpenAI function schema ({"type": "function", "function": {...}})
    timeout_s: float
    target: Any = None  # Python function or class
    url: Optional[str] = None

    @property
    def stateful(self) -> bool:
        return inspect.isclass(self.target)

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def _import_target(spec: str, where: str):
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ToolConfigError(f"{where}: function={spec!r} must be 'path/to/file.py:name'")
    if not os.path.isfile(path):
        raise ToolConfigError(f"{where}: tool file not found: {path!r} (relative paths start at {os.getcwd()!r})")
    module_name = "megarl_user_tool_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ToolConfigError(f"{where}: importing {path!r} failed: {type(e).__name__}: {e}") from e
    target = getattr(module, name, None)
    if target is None or not callable(target):
        raise ToolConfigError(f"{where}: {path!r} defines no function or class {name!r}")
    if inspect.isclass(target) and not hasattr(target, "execute"):
        raise ToolConfigError(f"{where}: class {name!r} is a stateful tool and needs an execute(**arguments) method")
    return target


def load_tools(path: str) -> "ToolSet":
    """Read and check a tool config file (see the module docstring). Raises ToolConfigError."""
    import yaml

    if not os.path.isfile(path):
        raise ToolConfigError(f"tool config {path!r} not found (relative paths start at {os.getcwd()!r})")
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{path}: expected a top-level 'tools:' list with at least one tool")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
        unknown = sorted(set(entry) - {"function", "url", "timeout_s", "schema"})
        if unknown:
            raise ToolConfigError(f"{where}: unknown keys {unknown}; expected function or url, timeout_s, schema")
        schema = entry.get("schema")
        fn = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolConfigError(f"{where}: schema must be an OpenAI function schema "
                                  "{type: function, function: {name, description, parameters}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object" or \
                not isinstance(params.get("properties", {}), dict):
            raise ToolConfigError(f"{where}: schema.function.parameters must be a JSON schema of type object with "
                                  "'properties'")
        missing = [k for k in params.get("required", []) if k not in params.get("properties", {})]
        if missing:
            raise ToolConfigError(f"{where}: required parameters {missing} are not in 'properties'")
        for pname, pschema in params.get("properties", {}).items():
            ptype = pschema.get("type") if isinstance(pschema, dict) else None
            if ptype is not None and ptype not in _JSON_TYPES:
                raise ToolConfigError(f"{where}: parameter {pname!r} has type {ptype!r}; expected one of "
                                      f"{sorted(_JSON_TYPES)}")
        if ("function" in entry) == ("url" in entry):
            raise ToolConfigError(f"{where}: give exactly one backend: function: path/file.py:name, or url: http://...")
        timeout = entry.get("timeout_s", 30)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ToolConfigError(f"{where}: timeout_s={timeout!r} must be a positive number of seconds")
        name = fn["name"]
        if name in tools:
            raise ToolConfigError(f"{where}: a second tool named {name!r}; tool names must be unique")
        url = entry.get("url")
        if url is not None and not str(url).startswith(("http://", "https://")):
            raise ToolConfigError(f"{where}: url={url!r} must start with http:// or https://")
        target = _import_target(str(entry["function"]), where) if "function" in entry else None
        tools[name] = Tool(name, {"type": "function", **schema}, float(timeout), target=target, url=url)
    return ToolSet(tools)


def check_arguments(arguments: dict, parameters: dict) -> Optional[str]:
    """Why `arguments` do not fit the JSON schema `parameters` (required keys, known keys, types, enums); None: fit."""
    props = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        schema = props[key] if isinstance(props[key], dict) else {}
        types = schema.get("type")
        if types is not None:
            allowed = tuple(t for name in ([types] if isinstance(types, str) else types) for t in _JSON_TYPES[name])
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                return f"argument {key!r} must be of type {types}, got {type(value).__name__}"
        if "enum" in schema and value not in schema["enum"]:
            return f"argument {key!r} must be one of {schema['enum']}, got {value!r}"
    return None


def _as_result(value: Any) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ToolResult(str(value))
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        reward = value.get("reward", 0.0)
        if not isinstance(reward, (int, float)) or reward != reward:
            return ToolResult(f"Error: the tool returned a non-numeric reward {reward!r}", error="bad_return")
        return ToolResult(value["text"], float(reward))
    return ToolResult(f"Error: the tool returned {type(value).__name__}; expected a string or "
                      "{\"text\": ..., \"reward\": ...}", error="bad_return")


def _post_json(url: str, payload: dict, timeout_s: float) -> ToolResult:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read().decode("utf-8", errors="replace")
            kind = response.headers.get_content_type()
    except urllib.error.HTTPError as e:
        return ToolResult(f"Error: the tool's server answered HTTP {e.code} {e.reason}", error="http")
    except (TimeoutError, OSError) as e:  # URLError is an OSError; a read timeout is a TimeoutError
        if isinstance(getattr(e, "reason", e), TimeoutError) or isinstance(e, TimeoutError):
            return ToolResult(f"Error: the tool did not answer within {timeout_s:g} s", error="timeout")
        return ToolResult(f"Error: the tool's server could not be reached ({e})", error="http")
    if kind == "application/json":
        try:
            return _as_result(json.loads(body))
        except ValueError:
            return ToolResult("Error: the tool's server sent invalid JSON", error="http")
    return ToolResult(body)


class ToolSet:
    """The declared tools, and the execution of calls with their per-trajectory state."""

    def __init__(self, tools: dict[str, Tool], max_workers: int = 16):
        self.tools = tools
        self._pool: Optional[ThreadPoolExecutor] = None
        self._max_workers = max_workers

    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="megarl-tool")
        return self._pool

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._executor(), lambda: fn(*args, **kwargs))

    async def _invoke(self, tool: Tool, arguments: dict, state: "TrajectoryState") -> ToolResult:
        if tool.url is not None:
            payload = {"name": tool.name, "arguments": arguments, "trajectory_id": state.trajectory_id}
            # the HTTP timeout is the per-call limit; the outer wait_for only backs it up
            return await self._in_thread(_post_json, tool.url, payload, tool.timeout_s)
        fn = tool.target
        if tool.stateful:
            instance = state.instances.get(tool.name)
            if instance is None:
                instance = state.instances[tool.name] = await self._in_thread(tool.target)
                if hasattr(instance, "create"):
                    created = instance.create(state.extra_info)
                    if inspect.isawaitable(created):
                        await created
            fn = instance.execute
        if inspect.iscoroutinefunction(fn):
            return _as_result(await fn(**arguments))
        return _as_result(await self._in_thread(fn, **arguments))

    async def execute(self, call: ToolCall, state: "TrajectoryState") -> ToolResult:
        """Run one parsed call; every failure comes back as a ToolResult with `error` set, never as an exception."""
        if call.error is not None:
            kind, message = call.error
            return ToolResult(f"Error: {message}", error=kind)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}",
                              error="unknown_tool")
        problem = check_arguments(call.arguments, tool.parameters)
        if problem:
            return ToolResult(f"Error: {tool.name}: {problem}", error="bad_arguments")
        try:
            # a sync function that overruns keeps its worker thread until it returns (threads cannot be killed);
            # the trajectory goes on at once with the timeout as the response
            return await asyncio.wait_for(self._invoke(tool, call.arguments, state), tool.timeout_s + 0.5 * bool(tool.url))
        except asyncio.TimeoutError:
            return ToolResult(f"Error: {tool.name} did not answer within {tool.timeout_s:g} s", error="timeout")
        except TypeError as e:
            return ToolResult(f"Error: {tool.name}: {e}", error="bad_arguments")
        except Exception as e:  # noqa: BLE001 - a failing tool is a response the model learns from
            return ToolResult(f"Error: {tool.name} raised {type(e).__name__}: {e}", error="exception")

    async def release(self, state: "TrajectoryState") -> None:
        """End a trajectory: release() every stateful instance it created (errors there are ignored)."""
        for instance in state.instances.values():
            release = getattr(instance, "release", None)
            if release is None:
                continue
            try:
                done = release()
                if inspect.isawaitable(done):
                    await done
            except Exception:  # noqa: BLE001 - the trajectory is over; a cleanup failure must not stop the run
                pass
        state.instances.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@dataclass
class TrajectoryState:
    trajectory_id: str
    extra_info: Optional[dict] = None
    instances: dict = field(default_factory=dict)


def truncate_text(text: str, limit: int, side: str) -> tuple[str, bool]:
    """Cut `text` to at most `limit` characters on `side` (left: keep the end; right: keep the start; middle: keep
    both ends, joined by '...'). Returns (text, whether it was cut)."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return text[len(text) - limit:], True
    if side == "right":
        return text[:limit], True
    if side != "middle":
        raise ValueError(f"truncate side {side!r}: expected left, right or middle")
    marker = "..."
    if limit <= len(marker):
        return text[:limit], True
    head = (limit - len(marker) + 1) // 2
    tail = limit - len(marker) - head
    return text[:head] + marker + (text[len(text) - tail:] if tail else ""), True
