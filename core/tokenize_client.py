"""The one client of a vLLM-style server's ``POST /tokenize`` (chat-template renders, plain encodes).

Used by the session player (``loadgen.session_player``: token-id prompts, expected reuse), the
text synthesizer (``loadgen.synth_text``: counting tokens) and the proxy (``serving.proxy``: the
ids a request will be rendered to, matched against a handle). vLLM's endpoint: ``{"model",
"messages" | "prompt", "add_generation_prompt", "add_special_tokens", ...}`` ->
``{"tokens": [int, ...], ...}`` (``vllm/entrypoints/serve/tokenize``). Imports nothing of
serving/, loadgen/ or dashboard/.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx

#: Fields of a chat request that change how its messages render (copied into a /tokenize request).
CHAT_RENDER_FIELDS = ("model", "messages", "tools", "chat_template", "chat_template_kwargs",
                      "add_generation_prompt", "continue_final_message")


class TokenizeError(RuntimeError):
    """The server's ``/tokenize`` failed or answered something that is not a token list."""


def tokens_from(url: str, resp: httpx.Response) -> list[int]:
    """The ``tokens`` list of a ``/tokenize`` response.

    Raises:
        TokenizeError: HTTP status other than 200, no ``tokens`` list, or not all integers.
    """
    if resp.status_code != 200:
        raise TokenizeError(f"POST {url}: HTTP {resp.status_code}: {resp.text[:300]}")
    try:
        tokens = resp.json()["tokens"]
    except (ValueError, KeyError, TypeError) as e:
        raise TokenizeError(f"POST {url}: no 'tokens' list in the response: {resp.text[:300]}") from e
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise TokenizeError(f"POST {url}: 'tokens' is not a list of integers")
    return tokens


def render_request(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` request that renders a generate request ``body`` as the worker will.

    ``endpoint`` ``/v1/completions``: ``{"model", "prompt"}`` (the server's default special tokens,
    as for the completion itself); otherwise the chat fields of :data:`CHAT_RENDER_FIELDS`, with
    ``add_generation_prompt`` true unless the body says otherwise.
    """
    if endpoint == "/v1/completions":
        return {"model": body.get("model"), "prompt": body.get("prompt")}
    req = {k: body[k] for k in CHAT_RENDER_FIELDS if k in body}
    req.setdefault("add_generation_prompt", True)
    return req


class TokenizeClient:
    """Sync client of the server's ``/tokenize`` (chat-template renders and plain encodes).

    Args:
        client: sync httpx client.
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/tokenize`` is appended).
        model: the model name sent in each request.
        timeout_s: per request, seconds.
        retries: a request that cannot reach the server, or gets 502/503/504 (a proxy or worker
            restarting), is tried again this many times, 0.25 s after the first failure and twice
            as long after each next one (about 16 s in all by default: a ``token_ids`` session
            cannot build its next prompt without it, and would stop).
    """

    def __init__(self, client: httpx.Client, base_url: str, model: str, timeout_s: float = 30.0,
                 retries: int = 6):
        self.client = client
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s
        self.retries = retries
        self.name = f"{self.url} ({model})"

    def __call__(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, or of the text ``prompt``.

        Raises:
            TokenizeError: HTTP or network failure, or a response without a ``tokens`` list.
        """
        body: dict[str, Any] = {"model": self.model, "add_special_tokens": add_special_tokens}
        if messages is not None:
            body.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
        else:
            body["prompt"] = prompt
        return tokens_from(self.url, self._post(body))

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text (plain encode, no special tokens), one request per text.

        Raises:
            TokenizeError: as :meth:`__call__`.
        """
        return [len(self(prompt=t)) for t in texts]

    def _post(self, body: dict[str, Any]) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.post(self.url, json=body, timeout=self.timeout_s)
            except httpx.TimeoutException as e:
                raise TokenizeError(f"POST {self.url}: {type(e).__name__}: {e} (timeout {self.timeout_s} s)") from e
            except httpx.TransportError as e:  # refused, reset, closed: the server may be restarting
                if attempt == self.retries:
                    raise TokenizeError(f"POST {self.url}: {type(e).__name__}: {e} "
                                        f"({attempt + 1} attempts)") from e
            except httpx.HTTPError as e:
                raise TokenizeError(f"POST {self.url}: {type(e).__name__}: {e}") from e
            else:
                if resp.status_code not in (502, 503, 504) or attempt == self.retries:
                    return resp
            time.sleep(0.25 * 2**attempt)  # gevent-patched under Locust
        raise AssertionError("unreachable")


async def tokenize_async(client: httpx.AsyncClient, base_url: str, body: dict[str, Any],
                         timeout_s: float, headers: dict[str, str] | None = None) -> list[int]:
    """One ``/tokenize`` request on an async client, no retries (the proxy's, under a session lock).
    ``headers``: the worker's (its API key).

    Raises:
        TokenizeError: HTTP or network failure, or a response without a ``tokens`` list.
    """
    url = base_url.rstrip("/") + "/tokenize"
    try:
        resp = await client.post(url, json=body, timeout=timeout_s, headers=headers)
    except httpx.HTTPError as e:
        raise TokenizeError(f"POST {url}: {type(e).__name__}: {e}") from e
    return tokens_from(url, resp)
