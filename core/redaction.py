"""Secrets out of everything turnscope saves: one redaction for the store and the settings.

The store passes every ``runs_log`` value and a few free-text columns through :func:`redact`
(``store.writer``); ``TurnscopeSettings.effective()`` passes the configuration it saves with
each run through it too (``turnscope.conductor.settings``). See docs/design.md.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
#: A name whose last word is one of these is a secret (the union of the store's and the settings' lists).
_SECRET_LAST_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "pass", "credential",
                                "credentials", "authorization", "auth", "cookie", "signature"})
_SECRET_ANY_WORDS = frozenset({"secret", "password", "passwd", "credentials", "authorization"})
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")


def secret_name(name: str) -> bool:
    """True for a key or flag name that holds a secret: its last word (split at ``_``, ``-``,
    ``.``) is key/token/secret/password/auth/... (``api_key``, ``HF_TOKEN``, ``--api-key``,
    ``AWS_SECRET_ACCESS_KEY``), or any word is secret/password/credentials/authorization.
    ``max_tokens`` is not one (plural); a number under ``kv_bytes_per_token`` is kept by
    :func:`redact`, which replaces only string values."""
    words = [w for w in re.split(r"[_.\-\s]+", name.lower()) if w]
    return bool(words) and (words[-1] in _SECRET_LAST_WORDS or any(w in _SECRET_ANY_WORDS for w in words))


def redact(value: Any, key: str | None = None) -> Any:
    """``value`` with secrets replaced by ``"***"`` (pure; nested dicts and lists are copied).

    A string under a secret-looking key (:func:`secret_name`) is replaced whole; in every other
    string, a URL's user-info (``http://user:pass@host`` -> ``http://***@host``) and a
    ``Bearer``/``Basic`` credential are replaced. In a list, the item after a secret-looking flag
    (``["--api-key", "sk-..."]``) and the value of ``--api-key=...`` are replaced.
    """
    if isinstance(value, str):
        if key is not None and value and secret_name(key):
            return REDACTED
        if "@" in value:
            value = _URL_USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", value)
        if " " in value or "\t" in value:
            value = _BEARER.sub(lambda m: m.group(1) + " " + REDACTED, value)
        return value
    if isinstance(value, dict):
        return {k: redact(v, k if isinstance(k, str) else None) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out: list[Any] = []
        hide_next = False
        for item in value:
            if hide_next and isinstance(item, str):
                out.append(REDACTED)
                hide_next = False
                continue
            hide_next = False
            if isinstance(item, str) and item.startswith("-"):
                flag, eq, _ = item.partition("=")
                if secret_name(flag):
                    if eq:
                        out.append(f"{flag}={REDACTED}")
                        continue
                    hide_next = True
            out.append(redact(item))
        return out
    return value
