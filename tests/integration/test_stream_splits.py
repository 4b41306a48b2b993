"""Every handed SSE case, split at every byte and re-encoded, gives the same recorded turn.

A stream's bytes reach the client in whatever pieces TCP and the server's writes make, and SSE
allows three line endings (LF, CRLF, CR) and ``data:`` with or without its space (WHATWG HTML,
"Server-sent events", "Interpreting an event stream"). None of that may change what a turn
records. Each handed case (tests/cases/sse) is re-encoded four ways and, for each encoding:

- one byte per read (every offset a boundary at once), through the real
  :func:`loadgen.stream_client.stream_turn` over httpx (an in-process ``MockTransport``, no
  sleeps), and one byte per HTTP chunk from the local stub server (tests/integration/http_stub.py)
  to :class:`~loadgen.stream_client.GeventClient`, whose line reader is its own;
- split into two pieces (two reads) at every byte offset for the LF stream, and at every offset
  within 3 bytes of a line terminator for the other encodings (where a CR ending one read and its
  LF starting the next must not make two line ends): about 16,000 streams in all.

Truth: the case's own ``expect`` (written by hand with the case) for the unsplit LF stream, and
that stream's recorded turn for every other split and encoding.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import gevent.socket
import httpx
import pytest

from loadgen.stream_client import GeventClient, TurnResult, stream_turn
from tests.handed_cases import CASES as HANDED
from tests.integration.http_stub import Script, StubServer

CASE_FILES = sorted((HANDED / "sse").glob("*.json"))
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ENCODINGS = ("lf", "crlf", "cr", "data_without_space")


def case_bytes(path: Path) -> bytes:
    """The whole stream of a handed case, as the server sent it (LF line endings)."""
    case = json.loads(path.read_text())
    if "fragments_b64" in case:
        return b"".join(base64.b64decode(f) for f in case["fragments_b64"])
    return b"".join(e["raw"].encode("utf-8") for e in case["events"])


def encode(raw: bytes, how: str) -> bytes:
    """``raw`` (LF line endings; JSON escapes its own newlines) with other line endings, or with
    ``data:`` lines that lose their optional space."""
    if how == "crlf":
        return raw.replace(b"\n", b"\r\n")
    if how == "cr":
        return raw.replace(b"\n", b"\r")
    if how == "data_without_space":
        return b"\n".join(line[:5] + line[6:] if line.startswith(b"data: ") else line for line in raw.split(b"\n"))
    return raw


def record(r: TurnResult) -> dict:
    """What a turn records that does not depend on timing (no sleeps here: times are ~0)."""
    return {"status": r.status, "error": r.error, "http_status": r.http_status, "text": r.text,
            "reasoning_text": r.reasoning_text, "finish_reason": r.finish_reason, "tool_calls": r.tool_calls,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "cached_tokens": r.cached_tokens, "token_ids": r.token_ids, "prompt_token_ids": r.prompt_token_ids,
            "proxy_facts": r.proxy_facts, "has_ttft": r.ttft_s is not None, "itl_kind": r.itl_kind,
            "itl_samples": len(r.itl_s), "request_id": r.request_id}


class PiecesServer:
    """An in-process httpx client whose every response body is the current ``pieces`` (one read each)."""

    def __init__(self):
        self.pieces: list[bytes] = []
        self.client = httpx.Client(transport=httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter(self.pieces))

    def turn(self, pieces: list[bytes]) -> TurnResult:
        self.pieces = pieces
        return stream_turn(self.client, "http://stub/v1/chat/completions", BODY, timeout_s=10)


SERVER = PiecesServer()


def turn_from_pieces(pieces: list[bytes]) -> TurnResult:
    """stream_turn over httpx, the response body arriving as ``pieces`` (one read each)."""
    return SERVER.turn(pieces)


def cuts(data: bytes, how: str) -> list[int]:
    """The offsets to split ``data`` at: all for LF, else those within 3 bytes of a CR or LF."""
    if how == "lf":
        return list(range(len(data) + 1))
    ends = [i for i, b in enumerate(data) if b in b"\r\n"]
    return sorted({c for i in ends for c in range(i - 3, i + 5) if 0 <= c <= len(data)})


def matches_expect(rec: dict, expect: dict) -> None:
    """The unsplit stream's record against the case's hand-written expectations."""
    assert rec["status"] == expect["status"], rec
    for k in ("text", "completion_tokens", "prompt_tokens", "finish_reason"):
        if k in expect:
            assert rec[k] == expect[k], k
    if "error_contains" in expect:
        assert expect["error_contains"] in (rec["error"] or "")
    if "tool_calls" in expect:
        assert [{"index": c["index"], "id": c.get("id"), "name": c["function"]["name"],
                 "arguments": c["function"]["arguments"]} for c in rec["tool_calls"]] == expect["tool_calls"]


@pytest.mark.parametrize("path", CASE_FILES, ids=[p.stem for p in CASE_FILES])
def test_every_split_of_every_encoding_records_the_same_turn(path: Path) -> None:
    raw = case_bytes(path)
    want = record(turn_from_pieces([raw]))
    matches_expect(want, json.loads(path.read_text())["expect"])
    for how in ENCODINGS:
        data = encode(raw, how)
        assert (data == raw) == (how == "lf")  # every case has lines to re-encode
        got = record(turn_from_pieces([data[i:i + 1] for i in range(len(data))]))
        assert got == want, (how, "one byte per read")
        for cut in cuts(data, how):
            got = record(turn_from_pieces([data[:cut], data[cut:]]))
            assert got == want, (how, cut, data[max(cut - 20, 0):cut], data[cut:cut + 20])


def test_one_byte_per_chunk_over_a_socket_to_the_gevent_client_records_the_same_turn() -> None:
    gevent.socket.getaddrinfo("127.0.0.1", 80)  # start gevent's resolver pool first
    for path in CASE_FILES:
        raw = case_bytes(path)
        want = record(turn_from_pieces([raw]))
        for how in ENCODINGS:
            data = encode(raw, how)
            with StubServer(Script(fragments=[(0.0, data[i:i + 1]) for i in range(len(data))])) as stub, \
                    GeventClient() as client:
                got = record(stream_turn(client, stub.url + "/v1/chat/completions", BODY, timeout_s=10))
            assert got == want, (path.stem, how)
