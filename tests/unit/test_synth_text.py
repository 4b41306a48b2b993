"""loadgen.synth_text: exact token counts, checked by encoding with the tokenizer itself."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from tokenizers import Tokenizer

from loadgen.synth_text import LocalTokenizer, ServerTokenizer, SynthError, TextSynth, find_unit_words
from tests.embedded_tokenizer import tokenizer_json


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_json()))


@pytest.fixture(scope="module")
def synth() -> TextSynth:
    return TextSynth(LocalTokenizer(tokenizer_json()), seed=11)


def n_tokens(hf: Tokenizer, text: str) -> int:
    return len(hf.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 128, 513, 4000])
def test_text_has_exactly_n_tokens(synth, hf, n):
    assert n_tokens(hf, synth.text(n, f"k{n}")) == n


def test_text_is_deterministic_per_seed_and_key(synth, hf):
    again = TextSynth(LocalTokenizer(tokenizer_json()), seed=11)
    assert synth.text(300, "a") == again.text(300, "a")
    assert synth.text(300, "a") != synth.text(300, "b")
    other_seed = TextSynth(LocalTokenizer(tokenizer_json()), seed=12)
    assert other_seed.text(300, "a") != synth.text(300, "a")


def test_unit_words_are_single_tokens(synth, hf):
    assert len(synth.units) >= 32
    for w in synth.units:
        assert len(hf.encode(" " + w, add_special_tokens=False).ids) == 1, w


def test_counts_hold_inside_a_chatml_message(synth, hf):
    # the content sits between "\n" and the special token <|im_end|>: it must keep its count
    body = synth.text(250, "msg")
    framed = hf.encode("<|im_start|>user\n" + body + "<|im_end|>\n", add_special_tokens=False).ids
    head = hf.encode("<|im_start|>user\n", add_special_tokens=False).ids
    tail = hf.encode("<|im_end|>\n", add_special_tokens=False).ids
    assert len(framed) == len(head) + 250 + len(tail)


def test_chain_text_shares_text_for_shared_hash_ids(synth, hf):
    block = 16
    a = synth.chain_text([5, 6, 7], 0, 40, block)       # blocks 5, 6 full, 8 tokens of block 7
    b = synth.chain_text([5, 6, 9, 10], 0, 64, block)    # same first two blocks, then others
    words_a, words_b = a.split(" ")[1:], b.split(" ")[1:]
    assert len(words_a) == 40 and len(words_b) == 64
    assert words_a[:32] == words_b[:32]                  # shared hash ids: same text
    assert words_a[32:] != words_b[32:40]                # different hash ids: different text
    # a partial block is a prefix of the same block's full text (a re-hashed parent's tokens)
    full7 = synth.chain_text([5, 6, 7], 0, 48, block).split(" ")[1:]
    assert full7[:40] == words_a
    # any window: positions [a, b) have exactly b - a tokens
    assert n_tokens(hf, synth.chain_text([5, 6, 7, 8], 13, 51, block)) == 38
    with pytest.raises(ValueError, match="outside a chain"):
        synth.chain_text([5], 0, 17, block)


class _Tokenize(BaseHTTPRequestHandler):
    tok: Tokenizer

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = self.tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens"))).ids
        data = json.dumps({"tokens": ids, "count": len(ids)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_server_tokenize_gives_the_same_exact_counts(hf):
    handler = type("H", (_Tokenize,), {"tok": hf})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with httpx.Client() as c:
            remote = TextSynth(ServerTokenizer(c, f"http://127.0.0.1:{srv.server_address[1]}", "m"), seed=3)
            for n in (1, 77, 600):
                assert n_tokens(hf, remote.text(n, f"r{n}")) == n
    finally:
        srv.shutdown()
        srv.server_close()


class _CharCounter:
    """A character-level tokenizer: no word is ever one token with its leading space."""

    name = "chars"

    def count(self, texts):
        return [len(t) for t in texts]

    def vocab_words(self):
        return []


def test_a_tokenizer_without_whole_words_is_refused():
    assert find_unit_words(_CharCounter(), ["ab", "cd"]) == []
    with pytest.raises(SynthError, match="only 0 words of one token"):
        TextSynth(_CharCounter())


class _Liar(_CharCounter):
    """Claims every ' word' is one token but counts joined text differently (merges across spaces)."""

    name = "liar"

    def count(self, texts):
        return [t.count(" ") if len(t) < 20 else t.count(" ") - 1 for t in texts]


def test_a_count_mismatch_is_an_error_not_a_silent_guess():
    with pytest.raises(SynthError, match="merges across spaces"):
        TextSynth(_Liar(), candidates=[f"w{chr(97 + i)}" for i in range(26)] + [f"x{chr(97 + i)}" for i in range(26)])
