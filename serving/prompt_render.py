"""The token guard's renderer: a request's prompt ids at a cost that follows the new tokens.

The proxy compares a request's rendered ids with the ids D holds KV for before it offers D's
handle (``serving.handles.fit_handle``). Rendering the whole conversation through P's
``/tokenize`` on every turn costs about 1.5-1.8 ms per 1,000 tokens of history (issue 15), so
:class:`IncrementalRenderer` keeps, per session, the previous request's rendered text and ids and
renders a new request in-process from the model's own tokenizer and chat template:

1. render the conversation to text with the chat template (``apply_chat_template``, no
   tokenizing: string work only);
2. if that text starts with the previous request's text, tokenize only the tail from the last
   *safe boundary*: the start of the last special token of the previous text (an added token
   with no ``lstrip``/``rstrip``/``normalized``). HF ``tokenizers`` cut the text at added tokens
   before anything else and encode the pieces between them independently, so
   ``ids(text[:b]) + ids(text[b:]) == ids(text)`` at such a boundary ``b`` (checked against the
   full encode in ``tests/unit/test_prompt_render.py``);
3. anything else (no previous render, a different prefix: an edit; different render options;
   a client-supplied ``chat_template``) returns None, and the proxy renders through P.

The in-process render is trusted for a session only after it gave exactly P's ids for that
session's first full render (:meth:`IncrementalRenderer.keep`); at the first disagreement the
renderer turns itself off for good: a model whose template or tokenizer P applies differently
never reaches step 2, so a wrong reuse stays impossible. vLLM's
chat ``/tokenize`` applies the template to text and encodes it with ``add_special_tokens=False``
(``vllm/entrypoints/serve/tokenize``), which is what step 1-2 do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("turnscope.proxy")

#: Body fields whose value changes how the template renders; the state is reused only when equal.
RENDER_OPTION_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                        "documents")


@dataclass
class _Rendered:
    """One session's previous render: text, ids, and the last safe boundary (char, token index)."""

    text: str
    ids: list[int]
    boundary_char: int
    boundary_token: int
    options: tuple


class IncrementalRenderer:
    """Chat-request ids rendered in-process, incrementally per session (see the module doc).

    Args:
        tokenizer_dir: a directory with ``tokenizer.json``, ``tokenizer_config.json`` and a chat
            template (the served model's directory).
        max_sessions: sessions remembered, least recently used first out.

    Raises:
        OSError / ValueError: the directory has no loadable tokenizer (from ``transformers``).
    """

    def __init__(self, tokenizer_dir: str | Path, max_sessions: int = 100_000):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        if not getattr(self.hf, "is_fast", False) or self.hf.chat_template is None:
            raise ValueError(f"{tokenizer_dir}: needs a fast tokenizer (tokenizer.json) and a chat template")
        self.fast = self.hf.backend_tokenizer
        self.safe_ids = frozenset(i for i, t in self.hf.added_tokens_decoder.items()
                                  if t.special and not (t.lstrip or t.rstrip or t.normalized))
        self.max_sessions = max_sessions
        self._state: OrderedDict[str, _Rendered] = OrderedDict()
        self.incremental_renders = 0  # requests served from the previous render (for tests and bench)
        self.disabled = False  # set at the first disagreement with P: everything renders through P

    @staticmethod
    def options_of(body: dict[str, Any]) -> tuple | None:
        """The render options of a chat body, or None when it cannot be rendered here."""
        if "chat_template" in body or not isinstance(body.get("messages"), list):
            return None
        return tuple(repr(body.get(k)) for k in RENDER_OPTION_FIELDS)

    def render_text(self, body: dict[str, Any]) -> str:
        """The chat template applied to the body's messages, as text (vLLM's chat rendering)."""
        return self.hf.apply_chat_template(
            body["messages"], tools=body.get("tools"), tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            **(body.get("chat_template_kwargs") or {}))

    def _encode(self, text: str, base_char: int, base_token: int) -> tuple[list[int], int, int]:
        """Ids of ``text`` and the last safe boundary in it, shifted by the bases."""
        enc = self.fast.encode(text, add_special_tokens=False)
        ids = enc.ids
        for j in range(len(ids) - 1, -1, -1):
            if ids[j] in self.safe_ids:
                return ids, base_char + enc.offsets[j][0], base_token + j
        return ids, -1, -1

    def full(self, body: dict[str, Any]) -> tuple[str, list[int], int, int]:
        """Render and encode the whole request: ``(text, ids, boundary_char, boundary_token)``."""
        text = self.render_text(body)
        ids, bc, bt = self._encode(text, 0, 0)
        return text, ids, bc, bt

    def render(self, session: str | None, body: dict[str, Any]) -> list[int] | None:
        """The request's ids from the session's previous render plus the new tail, or None when
        the previous render does not apply (the caller renders through P, then :meth:`keep`)."""
        options = self.options_of(body)
        prev = self._state.get(session) if session else None
        if self.disabled or options is None or prev is None or prev.options != options or prev.boundary_char < 0:
            return None
        text = self.render_text(body)
        if not text.startswith(prev.text):
            return None
        tail_ids, bc, bt = self._encode(text[prev.boundary_char:], prev.boundary_char, prev.boundary_token)
        if not tail_ids or tail_ids[0] != prev.ids[prev.boundary_token]:
            return None
        ids = prev.ids[:prev.boundary_token] + tail_ids
        if bc < 0:
            bc, bt = prev.boundary_char, prev.boundary_token
        self._remember(session, _Rendered(text, ids, bc, bt, options))
        self.incremental_renders += 1
        return ids

    def keep(self, session: str | None, body: dict[str, Any], p_ids: list[int]) -> bool:
        """After a render through P: render in-process too, and keep it for the session's next
        request only if it equals P's ids ``p_ids``. Returns whether it was kept."""
        options = self.options_of(body)
        if self.disabled or not session or options is None or not p_ids:
            return False
        text, ids, bc, bt = self.full(body)
        if ids != p_ids:
            log.warning("in-process render differs from P's /tokenize (%d vs %d ids); every request now "
                        "renders through P", len(ids), len(p_ids))
            self.disabled = True
            self._state.clear()
            return False
        self._remember(session, _Rendered(text, ids, bc, bt, options))
        return True

    def _remember(self, session: str, rendered: _Rendered) -> None:
        self._state[session] = rendered
        self._state.move_to_end(session)
        while len(self._state) > self.max_sessions:
            self._state.popitem(last=False)
