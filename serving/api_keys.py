"""API keys: where turnscope reads each one, never what it is.

Production vLLM servers run with ``--api-key`` (or ``VLLM_API_KEY``): every request under ``/v1``
needs ``Authorization: Bearer <key>``, while ``/health``, ``/metrics`` and ``/tokenize`` stay open
(vLLM 0.32 ``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``). A topology
names, per role, where the key of that role's workers is read from (:class:`SecretRef`: an
environment variable or a file), and where the key the proxy demands of its own clients is read
from. Only the reference is written anywhere (the proxy's configuration file, the run's saved
configuration); the key itself is read when a connection is made (docs/configuration.md).

The load generator and turnscope's own clients send the proxy's key from the environment variable
``core.contract.CLIENT_KEY_ENV`` (as the OpenAI SDK reads ``OPENAI_API_KEY``).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

#: The environment variable vLLM reads its ``--api-key`` from (``vllm/envs.py``): a launched worker
#: gets its role's key there, never on its command line.
VLLM_KEY_ENV = "VLLM_API_KEY"


class CredentialError(ValueError):
    """An API key cannot be read, or a server refused it; the message names whose key and where it
    was read from."""


class SecretRef(BaseModel):
    """Where one secret is read from: exactly one of ``env`` (an environment variable's name) or
    ``file`` (a file's path; its content, surrounding whitespace stripped). YAML:
    ``api_key: {env: VLLM_P_KEY}`` or ``api_key: {file: /run/secrets/p-key}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str | None = None
    file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable's name) or file (a path)")
        return self

    def describe(self) -> str:
        """Where the secret is read from, in words (never its value)."""
        return f"environment variable {self.env}" if self.env is not None else f"file {self.file}"

    def resolve(self, whose: str) -> str:
        """The secret's value. ``whose`` names it in errors (e.g. ``"the prefill role's api_key"``).
        Raises CredentialError when the variable is unset or empty, or the file unreadable or empty."""
        if self.env is not None:
            value = os.environ.get(self.env, "").strip()
        else:
            try:
                value = Path(self.file).read_text().strip()
            except OSError as exc:
                raise CredentialError(f"{whose}: cannot read {self.describe()}: {exc.strerror}") from None
        if not value:
            raise CredentialError(f"{whose}: {self.describe()} is unset or empty")
        return value


def bearer(key: str | None) -> dict[str, str]:
    """The ``Authorization`` header carrying ``key`` (``{}`` for no key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def resolve_optional(ref: SecretRef | None, whose: str) -> str | None:
    """``ref``'s value, or None when no key is configured. Raises CredentialError as
    :meth:`SecretRef.resolve`."""
    return ref.resolve(whose) if ref is not None else None
