"""A local stub of an OpenAI-compatible streaming server (vLLM-style) with a known tokenizer.

Speaks just enough of vLLM + turnscope's proxy for the loadgen tests:

* ``POST /tokenize``: ``{"messages", "add_generation_prompt"}`` renders ChatML
  (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, ``<|im_start|>assistant\\n`` as the
  generation prompt; tool calls rendered as JSON after the content), or ``{"prompt"}`` encodes text.
  The tokenizer is character level: ``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2, and
  each character c is ``CHAR_BASE + ord(c)``. One extra id, ``XY`` (5), decodes to ``"xy"`` but is
  never produced by encoding (which gives ``x``, ``y``): a generated XY re-tokenizes differently,
  like a non-canonical BPE split of a real model.
* ``POST /v1/chat/completions`` and ``/v1/completions`` (``stream: true``): waits ``ttft_s`` (plus ``prefill_s_per_token`` per prompt token), then
  streams the ids of ``reply_ids(request_index)`` one per chunk ``itl_s`` apart, with per-chunk
  usage, ``prompt_token_ids`` (chat: top level of the first chunk; completions: in the choice), a
  ``token_ids`` delta per chunk, a final chunk with ``finish_reason`` and the proxy's ``turnscope``
  facts, a usage-only chunk, then ``[DONE]``. Headers: ``x-request-id`` and the ``x-turnscope-*``
  facts (``miss_first_turn`` on a conversation's first request, ``hit`` after).
* ``fail_requests``: request indexes (0-based, over all completions requests) answered HTTP 500.

Every completions request body is kept in ``requests`` (with the rendered prompt ids in
``prompt_ids``) for assertions.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

BOS, IM_START, IM_END, XY = 0, 1, 2, 5
CHAR_BASE = 16
SPECIALS = {"<|endoftext|>": BOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}


def encode(text: str) -> list[int]:
    """Character-level encode with the special tokens recognised first."""
    out: list[int] = []
    i = 0
    while i < len(text):
        for s, sid in SPECIALS.items():
            if text.startswith(s, i):
                out.append(sid)
                i += len(s)
                break
        else:
            out.append(CHAR_BASE + ord(text[i]))
            i += 1
    return out


def decode_one(tid: int) -> str:
    if tid == XY:
        return "xy"
    inv = {v: k for k, v in SPECIALS.items()}
    if tid in inv:
        return ""  # skip_special_tokens, like vLLM's default
    return chr(tid - CHAR_BASE)


def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """ChatML, as the embedded model's template renders it."""
    s = ""
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content += json.dumps(m["tool_calls"])
        s += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
    if add_generation_prompt:
        s += "<|im_start|>assistant\n"
    return s


class StubState:
    """Configuration and observations of one stub server."""

    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.01,
                 reply_ids: Callable[[int], list[int]] | None = None,
                 fail_requests: set[int] | None = None, finish_reason: str = "length",
                 max_model_len: int | None = None, prefill_s_per_token: float = 0.0):
        self.ttft_s = ttft_s
        self.prefill_s_per_token = prefill_s_per_token  # added to ttft_s per prompt token
        self.max_model_len = max_model_len  # GET /v1/models says it (as vLLM does) when set
        self.itl_s = itl_s
        self.reply_ids = reply_ids or (lambda i: encode("ok") + [XY] + encode("."))
        self.fail_requests = set(fail_requests or ())
        self.finish_reason = finish_reason
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.conversations: dict[str, int] = {}
        self.tokenize_calls = 0
        self.finished: list[tuple[int, float]] = []  # (request index, time.time() after [DONE] was sent)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: StubState

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models" and self.state.max_model_len is not None:
            self._json(200, {"object": "list", "data": [{"id": "stub", "object": "model",
                                                         "max_model_len": self.state.max_model_len}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        st = self.state
        if self.path == "/tokenize":
            with st.lock:
                st.tokenize_calls += 1
            if "messages" in body:
                ids = encode(render(body["messages"], bool(body.get("add_generation_prompt", True))))
            else:
                ids = ([BOS] if body.get("add_special_tokens", True) else []) + encode(body["prompt"])
            self._json(200, {"tokens": ids, "count": len(ids), "max_model_len": 4096})
            return
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        chat = self.path == "/v1/chat/completions"
        prompt_ids = encode(render(body["messages"], True)) if chat else list(body["prompt"])
        with st.lock:
            idx = len(st.requests)
            st.requests.append({**body, "prompt_ids": prompt_ids, "path": self.path})
            conv = body.get("conversation_id") or ""
            seen = st.conversations.get(conv, 0)
            st.conversations[conv] = seen + 1
        if idx in st.fail_requests:
            self._json(500, {"error": {"message": f"injected failure of request {idx}"}})
            return
        gen = st.reply_ids(idx)[: body.get("max_tokens", 10**9)]
        rid = f"stub-{idx}-{uuid.uuid4().hex[:6]}"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.send_header("x-request-id", rid)
        self.send_header("x-turnscope-reuse", "miss_first_turn" if seen == 0 else "hit")
        self.send_header("x-turnscope-prefill-ms", "12.5")
        self.send_header("x-turnscope-prefill-engine", "stub-p0")
        self.send_header("x-turnscope-decode-engine", "stub-d0")
        self.end_headers()
        P = len(prompt_ids)

        def usage(c: int) -> dict[str, Any]:
            return {"prompt_tokens": P, "completion_tokens": c, "total_tokens": P + c,
                    "prompt_tokens_details": {"cached_tokens": 0 if seen == 0 else P // 2}}

        def send(obj: Any) -> None:
            self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            self.wfile.flush()

        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            send({"id": rid, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                  "prompt_token_ids": prompt_ids, "usage": usage(0)})
        time.sleep(st.ttft_s + st.prefill_s_per_token * len(prompt_ids or []))
        for i, t in enumerate(gen):
            if i:
                time.sleep(st.itl_s)
            piece = decode_one(t)
            choice: dict[str, Any] = {"index": 0, "token_ids": [t], "finish_reason": None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
                if i == 0:
                    choice["prompt_token_ids"] = prompt_ids
            send({"id": rid, "object": obj, "choices": [choice], "usage": usage(i + 1)})
        final: dict[str, Any] = {"index": 0, "finish_reason": st.finish_reason, "token_ids": []}
        final["delta" if chat else "text"] = {} if chat else ""
        send({"id": rid, "object": obj, "choices": [final], "usage": usage(len(gen)),
              "turnscope": {"prefill_cached_tokens": 0, "remote_tokens": P if seen else 0,
                            "reused_tokens": P if seen else 0, "recomputed_tokens": 0 if seen else P,
                            "handle_age_s": 0.5 if seen else None}})
        send({"id": rid, "object": obj, "choices": [], "usage": usage(len(gen))})
        send(b"[DONE]")
        with st.lock:
            st.finished.append((idx, time.time()))
        self.close_connection = True


class StubServer:
    """Run the stub on 127.0.0.1 (free port) in a daemon thread; use as a context manager."""

    def __init__(self, state: StubState | None = None):
        self.state = state or StubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
