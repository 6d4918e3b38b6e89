"""FakeOpenAI: a real OpenAI-compatible HTTP server on 127.0.0.1 for tests (no network, no mocks).

    with FakeOpenAI(lambda body, n: Reply("hi")) as server:
        client = OpenAIClient("m", base_url=server.base_url)

The responder gets each request's JSON body and its 0-based arrival index `n`, and returns what the server
does: `Reply` (a chat.completion the official SDK parses), `Status` (an HTTP error), `Delay` (sleep, then
answer) or `Garbage` (a 200 whose body is not JSON). Every request body is kept in `.requests` (arrival
order); `.headers` keeps each request's headers, `.max_in_flight` the most requests handled at once, and
`.errors` any exception the responder raised (answered as a 500).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Union


@dataclass
class Reply:
    content: str = ""
    tool_calls: list | None = None     # [{"name": str, "arguments": dict | str}] (or full OpenAI entries)
    reasoning: str | None = None       # sent as message.reasoning_content, as vLLM's reasoning parsers do


@dataclass
class Status:
    code: int
    body: str = ""                     # "" sends an OpenAI-style {"error": {...}} object


@dataclass
class Garbage:
    text: str


@dataclass
class Delay:
    seconds: float
    then: "Answer"


Answer = Union[Reply, Status, Garbage, Delay]
Responder = Callable[[dict, int], Answer]


def _tool_call_entry(i: int, call: dict) -> dict:
    if "function" in call:  # already in the OpenAI wire format
        return {"id": call.get("id", f"call_{i}"), "type": call.get("type", "function"), "function": call["function"]}
    args = call.get("arguments", {})
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def completion_json(body: dict, reply: Reply, n: int) -> dict:
    """A chat.completion object as the OpenAI API returns it."""
    message: dict = {"role": "assistant", "content": reply.content if (reply.content or not reply.tool_calls) else None}
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call_entry(i, c) for i, c in enumerate(reply.tool_calls)]
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in body.get("messages", []))
    completion_tokens = len(reply.content.split())
    return {"id": f"chatcmpl-fake-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class FakeOpenAI:
    """Serves POST /v1/chat/completions from a scriptable responder, in a daemon thread (a context manager)."""

    def __init__(self, responder: Responder):
        self.responder = responder
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.max_in_flight = 0
        self.errors: list[str] = []   # exceptions the responder raised (answered as 500s)
        self._in_flight = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeOpenAI is not running: use it as a context manager")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAI":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                fake._handle(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False  # a handler still sleeping in a Delay must not hold up shutdown
        # a short poll interval: shutdown() waits up to one interval for the serving loop to notice
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ serving

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        if h.path.rstrip("/") != "/v1/chat/completions":
            self._send(h, 404, json.dumps({"error": {"message": f"no route {h.path}", "type": "not_found"}}))
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(h, 400, json.dumps({"error": {"message": "request body is not JSON", "type": "bad_request"}}))
            return
        with self._lock:
            n = len(self.requests)
            self.requests.append(body)
            self.headers.append(dict(h.headers))
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            try:
                answer = self.responder(body, n)
            except Exception as e:  # a responder bug: answer 500 and keep it for the test to see
                self.errors.append(f"request {n}: {type(e).__name__}: {e}")
                answer = Status(500, json.dumps({"error": {"message": f"responder raised {type(e).__name__}"}}))
            while isinstance(answer, Delay):
                time.sleep(answer.seconds)
                answer = answer.then
            if isinstance(answer, Reply):
                code, text = 200, json.dumps(completion_json(body, answer, n))
            elif isinstance(answer, Status):
                code = answer.code
                text = answer.body or json.dumps({"error": {"message": f"fake status {answer.code}",
                                                            "type": "fake_error", "code": answer.code}})
            elif isinstance(answer, Garbage):
                code, text = 200, answer.text
            else:
                raise TypeError(f"the responder returned {type(answer).__name__}, not Reply/Status/Delay/Garbage")
        finally:
            # no longer in flight once the answer is ready: the client may send its next request as soon as the
            # reply's bytes arrive, before this thread would get back here after sending them
            with self._lock:
                self._in_flight -= 1
        self._send(h, code, text)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, text: str) -> None:
        data = text.encode()
        try:
            h.send_response(code)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
            pass
