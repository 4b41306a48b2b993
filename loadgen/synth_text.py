"""Synthesized prompt text with exact token counts for the served tokenizer (docs/workloads.md).

Token-count-only sources (the Mooncake and Azure traces, the archetypes of ``loadgen.workload``)
give lengths, not text. :class:`TextSynth` turns a length into text that the served tokenizer
encodes (``add_special_tokens=False``) into exactly that many tokens:

* It first finds *unit words*: words ``w`` for which ``" " + w`` is exactly one token. Candidates
  come from the tokenizer's own vocabulary (byte-level BPE ``Ġword`` / SentencePiece ``▁word``
  entries, when the tokenizer file is local) or from the words of the shipped tau-bench trace
  (when only the server's ``/tokenize`` is available). They are checked by counting: a chunk of
  k candidates written ``" w1 w2 ... wk"`` that encodes to k tokens holds only unit words (every
  ``" w"`` is its own pre-token, so each costs at least one token); a chunk that does not is split
  in halves until the culprits are found. Finally the text of all unit words is counted once more
  and must give exactly one token per word.
* A text of n tokens is then n unit words drawn with numpy's ``Generator`` seeded by
  ``(seed, key)``: the same key always gives the same text, in any process.
* :meth:`TextSynth.chain_text` gives the text of token positions ``[start, end)`` of a Mooncake
  hash chain: block ``h`` (``block_tokens`` tokens) always has the same words, so two requests
  that share hash ids share text, and a partial last block is a prefix of the full block's text
  (the trace's prefix sharing survives the synthesis, including a re-hashed partial block).
* Every text handed out is counted again by the tokenizer (``verify=True``, the default) and a
  mismatch raises :class:`SynthError`: the counts are checked, not assumed.

The counts are of the text alone. A chat template adds its own tokens around each message
(ChatML: ``<|im_start|>role\\n`` and ``<|im_end|>\\n``, 5 tokens with the embedded tokenizer, and 3
for the generation prompt); those are the template's, not the synthesized content's.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

from core import resources
from core.tokenize_client import TokenizeClient, TokenizeError

#: Words of this trace are the candidates when the tokenizer's vocabulary is not at hand.
_CANDIDATE_TRACE = resources.shipped("traces", "gpt-4o-airline.json")
_WORD = re.compile(r"^[a-z]{2,12}$")
_VOCAB_WORD = re.compile(r"^(?:\u0120|\u2581)([a-z]{2,12})$")  # Ġword (byte-level BPE) / ▁word (SentencePiece)
_MIN_UNITS = 32


class SynthError(RuntimeError):
    """Text could not be synthesized with the exact token count (the message says which count)."""


class TokenCounter(Protocol):
    """Counts tokens of plain texts as the served tokenizer does (no special tokens added)."""

    name: str

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text, in order."""
        ...

    def vocab_words(self) -> list[str]:
        """Candidate unit words from the tokenizer's vocabulary (may be empty)."""
        ...


class LocalTokenizer:
    """A ``tokenizer.json`` (HF ``tokenizers``) loaded in-process.

    Args:
        path: the ``tokenizer.json`` file, or a model directory that holds one (e.g. the embedded
            model's ``data/models/turnscope-tiny``).
    """

    def __init__(self, path: Path | str):
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no tokenizer.json (give the file or the model directory)")
        self.path = p
        self.name = str(p)
        self._tok = Tokenizer.from_file(str(p))

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text (``encode_batch``, ``add_special_tokens=False``)."""
        return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def vocab_words(self) -> list[str]:
        """Lower-case ASCII words of 2-12 letters that the vocabulary holds with a leading space."""
        out = set()
        for tok in self._tok.get_vocab():
            m = _VOCAB_WORD.match(tok)
            if m:
                out.add(m.group(1))
        return sorted(out)


class ServerTokenizer:
    """The server's ``/tokenize`` as a :class:`TokenCounter` (one request per text, no retries).

    Args:
        client: a sync httpx client.
        base_url: server root, e.g. ``http://127.0.0.1:8000``.
        model: the model name sent with each request.
        timeout_s: per request, seconds.
    """

    def __init__(self, client: httpx.Client, base_url: str, model: str, timeout_s: float = 30.0):
        self._client = TokenizeClient(client, base_url, model, timeout_s=timeout_s, retries=0)
        self.name = self._client.name

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text; raises :class:`SynthError` on an HTTP failure or a bad answer."""
        try:
            return self._client.count(texts)
        except TokenizeError as e:
            raise SynthError(str(e)) from e

    def vocab_words(self) -> list[str]:
        """None: the vocabulary is not exposed over HTTP (trace words are the candidates)."""
        return []


@lru_cache(maxsize=1)
def trace_words(path: Path = _CANDIDATE_TRACE, limit: int = 2048) -> tuple[str, ...]:
    """The ``limit`` most frequent lower-case words (2-12 ASCII letters) of the shipped tau-bench
    trace's message texts, most frequent first (ties alphabetical)."""
    counts: dict[str, int] = {}
    for traj in json.loads(Path(path).read_text(encoding="utf-8")):
        for m in traj.get("traj", []):
            c = m.get("content")
            if isinstance(c, str):
                for w in re.findall(r"[A-Za-z]+", c):
                    w = w.lower()
                    if _WORD.match(w):
                        counts[w] = counts.get(w, 0) + 1
    return tuple(sorted(counts, key=lambda w: (-counts[w], w))[:limit])


def seed_ints(key: str) -> list[int]:
    """Four 32-bit integers from a string key (blake2b), for numpy's SeedSequence."""
    d = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
    return [int.from_bytes(d[i:i + 4], "little") for i in range(0, 16, 4)]


def find_unit_words(counter: TokenCounter, candidates: Sequence[str], chunk: int = 64) -> list[str]:
    """The candidates ``w`` for which ``" " + w`` is exactly one token, by counting chunks.

    A chunk ``" w1 ... wk"`` of k tokens holds only unit words; otherwise it is halved until
    single words are reached. Returns them sorted (so the result does not depend on the order
    the candidates came in).
    """
    found: list[str] = []
    todo = [list(candidates[i:i + chunk]) for i in range(0, len(candidates), chunk)]
    while todo:
        batch = todo[:64]
        todo = todo[64:]
        counts = counter.count(["".join(" " + w for w in ws) for ws in batch])
        for ws, n in zip(batch, counts, strict=True):
            if n == len(ws):
                found.extend(ws)
            elif len(ws) > 1:
                h = len(ws) // 2
                todo.extend([ws[:h], ws[h:]])
    return sorted(set(found))


class TextSynth:
    """Deterministic text with exact token counts (see the module doc).

    Args:
        counter: the served tokenizer (:class:`LocalTokenizer` or :class:`ServerTokenizer`).
        seed: mixed into every text's random stream; the same (seed, key) gives the same text.
        verify: count every text handed out and raise :class:`SynthError` on a mismatch.
        candidates: candidate unit words; default: the tokenizer's vocabulary words, plus the
            tau-bench trace's words when the vocabulary gives fewer than 32 unit words.

    Raises:
        SynthError: fewer than 32 unit words, or their concatenation is not one token per word.
    """

    def __init__(self, counter: TokenCounter, seed: int = 0, *, verify: bool = True,
                 candidates: Sequence[str] | None = None):
        self.counter = counter
        self.seed = int(seed)
        self.verify = verify
        if candidates is None:
            units = find_unit_words(counter, counter.vocab_words())
            if len(units) < _MIN_UNITS:
                units = sorted(set(units) | set(find_unit_words(counter, trace_words())))
        else:
            units = find_unit_words(counter, candidates)
        if len(units) < _MIN_UNITS:
            raise SynthError(f"tokenizer {counter.name}: only {len(units)} words of one token each were found "
                             f"(need {_MIN_UNITS}); give a tokenizer.json whose vocabulary has whole words")
        (n,) = counter.count(["".join(" " + w for w in units)])
        if n != len(units):
            raise SynthError(f"tokenizer {counter.name}: {len(units)} one-token words joined encode to {n} "
                             f"tokens, not {len(units)}: the tokenizer merges across spaces")
        self.units = units
        self._unit_arr = np.array([" " + w for w in units], dtype=object)

    # -- word streams -------------------------------------------------------------------------

    def _indices(self, key: str, n: int) -> np.ndarray:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, *seed_ints(key)]))
        return rng.integers(0, len(self.units), size=n)

    def _join(self, idx: np.ndarray) -> str:
        return "".join(self._unit_arr[idx].tolist()) if len(idx) else ""

    def _check(self, text: str, n: int, what: str) -> str:
        if self.verify and n > 0:
            (got,) = self.counter.count([text])
            if got != n:
                raise SynthError(f"{what}: synthesized text encodes to {got} tokens, not {n} "
                                 f"(tokenizer {self.counter.name})")
        return text

    def text(self, n_tokens: int, key: str) -> str:
        """Text of exactly ``n_tokens`` tokens (``""`` for 0), the same for the same ``key``.

        Raises:
            ValueError: ``n_tokens`` < 0.
            SynthError: the tokenizer does not count ``n_tokens`` (``verify``).
        """
        n = int(n_tokens)
        if n < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return self._check(self._join(self._indices(key, n)), n, f"text(key={key!r})")

    def block_indices(self, hash_id: int, block_tokens: int) -> np.ndarray:
        """The unit-word indices of one hash block (``block_tokens`` of them), fixed per (seed, hash id)."""
        return self._indices(f"block:{block_tokens}:{int(hash_id)}", block_tokens)

    def chain_text(self, hash_ids: Sequence[int], start: int, end: int, block_tokens: int) -> str:
        """Text of token positions ``[start, end)`` of a prompt made of hash blocks.

        Position p lies in block ``hash_ids[p // block_tokens]`` at offset ``p % block_tokens``;
        the block's words depend only on its hash id, so prompts sharing hash ids share text.

        Raises:
            ValueError: ``0 <= start <= end <= len(hash_ids) * block_tokens`` does not hold.
            SynthError: the tokenizer does not count ``end - start`` (``verify``).
        """
        if not (0 <= start <= end <= len(hash_ids) * block_tokens):
            raise ValueError(f"positions [{start}, {end}) outside a chain of {len(hash_ids)} blocks "
                             f"of {block_tokens} tokens")
        parts = []
        for b in range(start // block_tokens, (end + block_tokens - 1) // block_tokens):
            lo = max(start, b * block_tokens) - b * block_tokens
            hi = min(end, (b + 1) * block_tokens) - b * block_tokens
            parts.append(self.block_indices(hash_ids[b], block_tokens)[lo:hi])
        idx = np.concatenate(parts) if parts else np.array([], dtype=int)
        return self._check(self._join(idx), end - start, f"chain_text([{start}, {end}))")


def counter_from(tokenizer: str | Path | None, *, client: httpx.Client | None = None,
                 base_url: str | None = None, model: str | None = None) -> Any:
    """A :class:`TokenCounter`: the local ``tokenizer`` (file or model dir) when given, else the
    server's ``/tokenize`` at ``base_url`` (``client`` and ``model`` required then)."""
    if tokenizer:
        return LocalTokenizer(tokenizer)
    if client is None or not base_url or not model:
        raise ValueError("no tokenizer file given and no server (client, base_url, model) to ask")
    return ServerTokenizer(client, base_url, model)
