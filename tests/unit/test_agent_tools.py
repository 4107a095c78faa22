"""Tools of multi-turn rollouts: config loading, argument checks, Python and HTTP backends, and that every bad input
becomes an error response of its kind instead of an exception."""
import asyncio
import json
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.agent.parse import parse_hermes
from megarl.agent.tools import (ToolCall, ToolConfigError, TrajectoryState, check_arguments, load_tools,
                                truncate_text)

TOOLS_PY = textwrap.dedent('''
    import asyncio, time

    def calculator(expression):
        return str(eval(expression, {"__builtins__": {}}))

    def boom(x):
        raise RuntimeError("exploded")

    def slow(x):
        time.sleep(2)
        return "late"

    async def aslow(x):
        await asyncio.sleep(5)
        return "late"

    def rewarded(x):
        return {"text": "ok " + x, "reward": 0.25}

    def odd(x):
        return ["not", "text"]

    class Counter:
        instances = []
        def __init__(self):
            self.count, self.released = 0, False
            Counter.instances.append(self)
        def create(self, extra_info):
            self.start = (extra_info or {}).get("start", 0)
        async def execute(self, step):
            self.count += step
            return str(self.start + self.count)
        def release(self):
            self.released = True
''')


def _schema(name, props, required):
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


def _write_config(tmp_path, extra=()):
    (tmp_path / "t.py").write_text(TOOLS_PY)
    x = {"x": {"type": "string"}}
    tools = [
        {"function": f"{tmp_path}/t.py:calculator", "schema": _schema("calculator", {"expression": {"type": "string"}},
                                                                       ["expression"])},
        {"function": f"{tmp_path}/t.py:boom", "schema": _schema("boom", x, ["x"])},
        {"function": f"{tmp_path}/t.py:slow", "timeout_s": 0.3, "schema": _schema("slow", x, ["x"])},
        {"function": f"{tmp_path}/t.py:aslow", "timeout_s": 0.3, "schema": _schema("aslow", x, ["x"])},
        {"function": f"{tmp_path}/t.py:rewarded", "schema": _schema("rewarded", x, ["x"])},
        {"function": f"{tmp_path}/t.py:odd", "schema": _schema("odd", x, ["x"])},
        {"function": f"{tmp_path}/t.py:Counter", "schema": _schema("counter", {"step": {"type": "integer"}},
                                                                    ["step"])},
        *extra,
    ]
    import yaml

    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    return str(path)


def _run(tools, name, args, state=None):
    state = state or TrajectoryState("t0")
    return asyncio.run(tools.execute(ToolCall(name, args), state))


def test_python_tool_answers(tmp_path):
    tools = load_tools(_write_config(tmp_path))
    r = _run(tools, "calculator", {"expression": "37*48"})
    assert (r.text, r.error, r.reward) == ("1776", None, 0.0)
    r = _run(tools, "rewarded", {"x": "a"})
    assert (r.text, r.reward) == ("ok a", 0.25)


@pytest.mark.parametrize("name,args,kind,words", [
    ("nope", {}, "unknown_tool", "unknown tool 'nope'"),
    ("calculator", {}, "bad_arguments", "missing required argument"),
    ("calculator", {"expression": 3}, "bad_arguments", "must be of type string"),
    ("calculator", {"expression": "1", "extra": 1}, "bad_arguments", "unknown argument"),
    ("boom", {"x": "1"}, "exception", "RuntimeError: exploded"),
    ("slow", {"x": "1"}, "timeout", "did not answer within 0.3 s"),
    ("aslow", {"x": "1"}, "timeout", "did not answer within 0.3 s"),
    ("odd", {"x": "1"}, "bad_return", "returned list"),
])
def test_bad_calls_become_error_responses(tmp_path, name, args, kind, words):
    tools = load_tools(_write_config(tmp_path))
    t0 = time.perf_counter()
    r = _run(tools, name, args)
    assert r.error == kind and r.text.startswith("Error: ") and words in r.text
    assert time.perf_counter() - t0 < 1.5  # a timeout does not wait for the tool


def test_malformed_calls_are_parse_errors():
    calls = parse_hermes('a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> '
                         '<tool_call>{"name": calc</tool_call><tool_call>[1]</tool_call>'
                         '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name"')
    assert calls[0].name == "calculator" and calls[0].arguments == {"expression": "1+2"} and calls[0].error is None
    assert calls[1].error[0] == "parse" and "not valid JSON" in calls[1].error[1]
    assert calls[2].error[0] == "parse" and "JSON object" in calls[2].error[1]
    assert calls[3].arguments == {"a": 1}  # arguments given as a JSON string
    assert calls[4].error == ("parse", "a <tool_call> without its closing </tool_call>")
    assert parse_hermes("#### 12") == []


def test_stateful_tool_lives_for_one_trajectory(tmp_path):
    tools = load_tools(_write_config(tmp_path))
    cls = tools.tools["counter"].target

    async def trajectory(tid, start):
        state = TrajectoryState(tid, {"start": start})
        out = [(await tools.execute(ToolCall("counter", {"step": s}), state)).text for s in (1, 2, 3)]
        await tools.release(state)
        return out

    async def both():
        return await asyncio.gather(trajectory("a", 0), trajectory("b", 100))

    assert asyncio.run(both()) == [["1", "3", "6"], ["101", "103", "106"]]
    assert len(cls.instances) == 2 and all(i.released for i in cls.instances)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/search":
            out = json.dumps({"text": f"found {body['arguments']['q']} for {body['trajectory_id']}", "reward": 0.5})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        elif self.path == "/plain":
            out = "plain text"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
        elif self.path == "/slow":
            time.sleep(1.5)
            out = "late"
            self.send_response(200)
        else:
            out = "no"
            self.send_response(503)
        data = out.encode()
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_tool_served_locally(tmp_path, server):
    q = {"q": {"type": "string"}}
    extra = [{"url": f"{server}/search", "schema": _schema("search", q, ["q"])},
             {"url": f"{server}/plain", "schema": _schema("plain", q, ["q"])},
             {"url": f"{server}/broken", "schema": _schema("broken", q, ["q"])},
             {"url": f"{server}/slow", "timeout_s": 0.3, "schema": _schema("slow_http", q, ["q"])},
             {"url": "http://127.0.0.1:9/x", "timeout_s": 2, "schema": _schema("down", q, ["q"])}]
    tools = load_tools(_write_config(tmp_path, extra))
    r = _run(tools, "search", {"q": "cats"}, TrajectoryState("7-1"))
    assert (r.text, r.reward, r.error) == ("found cats for 7-1", 0.5, None)
    assert _run(tools, "plain", {"q": "x"}).text == "plain text"
    r = _run(tools, "broken", {"q": "x"})
    assert r.error == "http" and "HTTP 503" in r.text
    r = _run(tools, "slow_http", {"q": "x"})
    assert r.error == "timeout"
    r = _run(tools, "down", {"q": "x"})
    assert r.error == "http" and "could not be reached" in r.text


@pytest.mark.parametrize("mutate,words", [
    (lambda t: t[0].pop("schema"), "OpenAI function schema"),
    (lambda t: t[0].update(url="http://x"), "exactly one backend"),
    (lambda t: t[0].update(function="nofile.py:f"), "tool file not found"),
    (lambda t: t[0].update(timeout_s=0), "positive number"),
    (lambda t: t.append(dict(t[0])), "a second tool named"),
    (lambda t: t[0]["schema"]["function"]["parameters"]["required"].append("zzz"), "not in 'properties'"),
    (lambda t: t[0].update(colour="red"), "unknown keys"),
])
def test_bad_tool_configs_are_refused(tmp_path, mutate, words):
    import yaml

    path = _write_config(tmp_path)
    doc = yaml.safe_load(open(path))
    mutate(doc["tools"])
    open(path, "w").write(yaml.safe_dump(doc))
    with pytest.raises(ToolConfigError, match=words.replace("(", r"\(")):
        load_tools(path)


def test_argument_checks_and_truncation():
    params = {"properties": {"n": {"type": "integer"}, "f": {"type": "number"}, "mode": {"enum": ["a", "b"]}},
              "required": ["n"]}
    assert check_arguments({"n": 3, "f": 2}, params) is None
    assert "type integer" in check_arguments({"n": True}, params)  # a bool is not an integer in JSON
    assert "one of" in check_arguments({"n": 1, "mode": "c"}, params)
    assert truncate_text("abcdefghij", 20, "middle") == ("abcdefghij", False)
    assert truncate_text("abcdefghij", 4, "left") == ("ghij", True)
    assert truncate_text("abcdefghij", 4, "right") == ("abcd", True)
    assert truncate_text("abcdefghij", 7, "middle") == ("ab...ij", True)
