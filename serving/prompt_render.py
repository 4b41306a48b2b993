"""The token guard's renderer: a request's prompt ids at a cost that follows the new tokens.

The proxy compares a request's rendered ids with the ids D holds KV for before it offers D's
handle (``serving.handles.fit_handle``). Rendering the whole conversation through P's
``/tokenize`` on every turn costs about 1.5-1.8 ms per 1,000 tokens of history (measured: bench/guard_cost.py), so
:class:`IncrementalRenderer` keeps, per session, the previous request's messages, the ids of its
rendered text up to the last *safe boundary* and the text after it, and renders a new request
in-process with the model's own tokenizer and chat template:

1. the new text. When the chat template is *message-local* (:class:`MessageLocalTemplate`: one
   ``for`` over ``messages`` whose body reads only its own message, nothing else reads
   ``messages``; a static check of the template's Jinja AST), the text is
   ``head + piece(m1) + ... + piece(mN) + tail``. If the request's messages start with the
   previous request's messages (a list comparison in C) and the head is unchanged, only the new
   messages are rendered, so the cost follows the new messages. Any other template is rendered
   whole (``apply_chat_template``, string work only) and its text must start with the previous
   text;
2. only the text from the previous render's last safe boundary is tokenized. A safe boundary is
   the start of a special token (an added token with no ``lstrip``/``rstrip``/``normalized``):
   HF ``tokenizers`` cut the text at added tokens before anything else and encode the pieces
   between them independently, so ``ids(text[:b]) + ids(text[b:]) == ids(text)`` at such a
   boundary ``b`` (checked against the full encode in ``tests/unit/test_prompt_render.py``);
3. anything else (no previous render, an edited or shorter history, different render options,
   a changed head, ``continue_final_message``, a client-supplied ``chat_template``) returns None,
   and the proxy renders through P.

The in-process render is trusted for a session only after it gave exactly P's ids for that
session's first full render (:meth:`IncrementalRenderer.keep`); at the first disagreement the
renderer turns itself off for good: a model whose template or tokenizer P applies differently
never reaches step 1, so a wrong reuse stays impossible. vLLM's chat ``/tokenize`` applies the
template to text and encodes it with ``add_special_tokens=False``
(``vllm/entrypoints/serve/tokenize``), which is what steps 1-2 do. Ids are kept as int64 numpy
arrays, so extending and comparing them are memory copies, not Python loops.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("turnscope.proxy")

#: Body fields whose value changes how the template renders; the state is reused only when equal.
RENDER_OPTION_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                        "documents")

IDS_DTYPE = np.int64


class MessageLocalTemplate:
    """A chat template whose text is ``head + piece(m1) + ... + piece(mN) + tail``.

    :meth:`of` accepts a template (Jinja source) only when its AST has exactly one top-level
    ``{% for x in messages %}`` (no ``else``, filter or recursion), ``messages`` is read nowhere
    else, ``loop`` is read nowhere, and nothing assigns, breaks, continues, includes, imports,
    defines macros or call blocks. Then each message's piece depends only on that message and
    the render options, and the head (the nodes before the loop) and tail (after it) not on the
    messages at all. The three parts are compiled from the same AST in ``transformers``' own chat-template
    environment (same filters and globals).
    """

    FORBIDDEN = ("Assign", "AssignBlock", "Macro", "CallBlock", "Include", "Import", "FromImport", "Extends",
                 "Block", "Break", "Continue", "ExprStmt", "Scope", "OverlayScope", "ScopedEvalContextModifier",
                 "EvalContextModifier", "FilterBlock", "With")

    def __init__(self, head, loop, tail):
        self.head_template, self.loop_template, self.tail_template = head, loop, tail

    @classmethod
    def of(cls, source: str) -> MessageLocalTemplate | None:
        """The split template, or None when ``source`` is not message-local (see the class doc)."""
        from jinja2 import nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(source).environment
        try:
            ast = env.parse(source)
        except Exception:  # noqa: BLE001  (a template transformers compiled but we cannot read: not local)
            return None
        loops = [i for i, n in enumerate(ast.body) if isinstance(n, nodes.For)
                 and isinstance(n.iter, nodes.Name) and n.iter.name == "messages"]
        if len(loops) != 1:
            return None
        loop = ast.body[loops[0]]
        if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
            return None
        if any(type(n).__name__ in cls.FORBIDDEN for n in ast.find_all(nodes.Node)):
            return None
        loads = [n.name for n in ast.find_all(nodes.Name) if n.ctx == "load"]
        if loads.count("messages") != 1 or "loop" in loads:
            return None
        outside = [n for i, node in enumerate(ast.body) if i != loops[0] for n in node.find_all(nodes.Name)]
        if any(n.name == loop.target.name for n in outside):
            return None
        parts = []
        for body in (ast.body[:loops[0]], [loop], ast.body[loops[0] + 1:]):
            part = nodes.Template(body, lineno=1)
            part.set_environment(env)
            parts.append(env.from_string(part))
        return cls(*parts)

    def render(self, context: dict[str, Any]) -> tuple[str, str, str]:
        """``(head, pieces of context["messages"], tail)`` for a render context (the keyword
        arguments of the full render)."""
        return (self.head_template.render(**context), self.loop_template.render(**context),
                self.tail_template.render(**context))


@dataclass
class _Rendered:
    """One session's previous render.

    ``ids``: the ids of its text before the last safe boundary; ``tail``: the text from that
    boundary on (up to the end of the last message's piece for a message-local template; to the
    end of the text otherwise); ``text``: the whole text (only for a template that is not
    message-local); ``messages`` and ``head``: what the render was made of.
    """

    ids: np.ndarray
    boundary_id: int
    tail: str
    options: tuple
    messages: list
    head: str | None
    text: str | None


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
        self.local = MessageLocalTemplate.of(self.hf.chat_template)
        self.max_sessions = max_sessions
        self._state: OrderedDict[str, _Rendered] = OrderedDict()
        self.incremental_renders = 0  # requests served from the previous render (for tests and bench)
        self.disabled = False  # set at the first disagreement with P: everything renders through P

    @staticmethod
    def options_of(body: dict[str, Any]) -> tuple | None:
        """The render options of a chat body, or None when it cannot be rendered here."""
        if ("chat_template" in body or body.get("continue_final_message")
                or not isinstance(body.get("messages"), list)):
            return None
        return tuple(repr(body.get(k)) for k in RENDER_OPTION_FIELDS)

    def render_text(self, body: dict[str, Any]) -> str:
        """The chat template applied to the body's messages, as text (vLLM's chat rendering)."""
        return self.hf.apply_chat_template(
            body["messages"], tools=body.get("tools"),
            documents=body.get("documents"), tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            **(body.get("chat_template_kwargs") or {}))

    def _parts(self, body: dict[str, Any], messages: list) -> tuple[str, str, str] | None:
        """The message-local template's ``(head, pieces of messages, tail)`` for this body (the
        context ``transformers`` builds: special tokens, ``chat_template_kwargs``, the options),
        or None when the template is not message-local."""
        if self.local is None:
            return None
        context = {**self.hf.special_tokens_map, **(body.get("chat_template_kwargs") or {}),
                   "messages": messages, "tools": body.get("tools"), "documents": body.get("documents"),
                   "add_generation_prompt": body.get("add_generation_prompt", True)}
        return self.local.render(context)

    def _split(self, tail: str, stable_end: int) -> tuple[list[int], int, int]:
        """Encode ``tail``: its ids, and the token index and char offset of its last safe
        boundary at or before char ``stable_end`` (``-1, -1``: none)."""
        enc = self.fast.encode(tail, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
        for j in range(len(ids) - 1, -1, -1):
            if ids[j] in self.safe_ids and offsets[j][0] <= stable_end:
                return ids, j, offsets[j][0]
        return ids, -1, -1

    def _extend(self, prev: _Rendered | None, tail: str, stable_end: int, options: tuple, messages: list,
                head: str | None, text: str | None) -> tuple[np.ndarray, _Rendered | None] | None:
        """The request's ids (``prev.ids`` + the ids of ``tail``) and the state for its next request
        (None: no safe boundary to keep). None when the tail does not open with the previous
        boundary's special token (it would not be a boundary of the new text)."""
        tail_ids, j, char = self._split(tail, stable_end)
        prefix = prev.ids if prev is not None else np.empty(0, dtype=IDS_DTYPE)
        if prev is not None and (not tail_ids or tail_ids[0] != prev.boundary_id):
            return None
        ids = np.concatenate((prefix, np.asarray(tail_ids, dtype=IDS_DTYPE)))
        if j < 0:
            return ids, None
        state = _Rendered(ids=ids[:len(prefix) + j], boundary_id=tail_ids[j], tail=tail[char:stable_end],
                          options=options, messages=messages, head=head, text=text)
        return ids, state

    def full(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        """Render and encode the whole request: ``(text, ids)``."""
        text = self.render_text(body)
        return text, self.fast.encode(text, add_special_tokens=False).ids

    def render(self, session: str | None, body: dict[str, Any]) -> np.ndarray | None:
        """The request's ids (int64 array) from the session's previous render plus the new
        tail, or None when the previous render does not apply (the caller renders through P,
        then :meth:`keep`)."""
        options = self.options_of(body)
        prev = self._state.get(session) if session else None
        if self.disabled or options is None or prev is None or prev.options != options:
            return None
        messages = body["messages"]
        if prev.text is None:  # message-local: render the new messages only
            k = len(prev.messages)
            if len(messages) <= k or messages[:k] != prev.messages:
                return None
            head, pieces, end = self._parts(body, messages[k:])
            if head != prev.head:
                return None
            tail = prev.tail + pieces + end
            stable_end = len(tail) - len(end)
            text = None
        else:
            text = self.render_text(body)
            cut = len(text) - len(prev.tail)
            if not text.startswith(prev.text) or cut < 0:
                return None
            boundary = len(prev.text) - len(prev.tail)
            tail, stable_end = text[boundary:], len(text) - boundary
        done = self._extend(prev, tail, stable_end, options, list(messages), prev.head, text)
        if done is None:
            return None
        ids, state = done
        if state is None:  # keep the previous boundary: its ids, and the text from it on
            state = _Rendered(ids=prev.ids, boundary_id=prev.boundary_id, tail=tail[:stable_end], options=options,
                              messages=list(messages), head=prev.head, text=text)
        self._remember(session, state)
        self.incremental_renders += 1
        return ids

    def keep(self, session: str | None, body: dict[str, Any], p_ids) -> bool:
        """After a render through P: render in-process too, and keep it for the session's next
        request only if it equals P's ids ``p_ids``. Returns whether it was kept."""
        options = self.options_of(body)
        if self.disabled or not session or options is None or len(p_ids) == 0:
            return False
        text, ids = self.full(body)
        if not np.array_equal(ids, p_ids):
            log.warning("in-process render differs from P's /tokenize (%d vs %d ids); every request now "
                        "renders through P", len(ids), len(p_ids))
            self.disabled = True
            self._state.clear()
            return False
        parts = self._parts(body, body["messages"])
        if parts is not None and "".join(parts) == text:  # the split renders exactly the full template
            done = self._extend(None, text, len(text) - len(parts[2]), options, list(body["messages"]), parts[0],
                                None)
        else:
            done = self._extend(None, text, len(text), options, list(body["messages"]), None, text)
        if done is None or done[1] is None:
            return False
        self._remember(session, done[1])
        return True

    def _remember(self, session: str, rendered: _Rendered) -> None:
        self._state[session] = rendered
        self._state.move_to_end(session)
        while len(self._state) > self.max_sessions:
            self._state.popitem(last=False)
