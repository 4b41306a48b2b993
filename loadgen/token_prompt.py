"""Build the next turn's prompt from token ids, the way RL rollout clients do (docs/workloads.md, `token_ids`).

Turn ``k+1``'s prompt is::

    prompt_k + generated_k + [end_of_turn if generated_k does not end with it] + separator
             + render(new messages, add_generation_prompt=True, add_special_tokens=False)

so the history is never re-tokenized and the ids match what the server computed exactly.

For ChatML (the embedded model's template, ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message, then ``<|im_start|>assistant\\n`` as the generation prompt) this is::

    ... <|im_start|>assistant\\n  <generated ids>  <|im_end|>  \\n  <|im_start|>user\\n ... <|im_end|>\\n<|im_start|>assistant\\n
        '-- end of prompt_k --'                    '- eot -'  'sep' '----- new messages rendered alone -----------------'

i.e. ``end_of_turn_ids = [<|im_end|>]`` and ``separator_ids = [id of "\\n"]``; the ``\\n`` is a
token of its own because it sits between two special tokens. A generation stopped by EOS already
ends with ``<|im_end|>`` (vLLM returns the EOS id in ``token_ids``) and gets only the separator;
one stopped by length (or by a stop string) gets both.

The ids are not assumed: :func:`calibrate_joiner` derives them from the server's own ``/tokenize``
(three renders of a tiny conversation) and fails loudly when the template does not render the
history as "previous prompt + reply + joiner + new messages" (e.g. templates that strip reasoning
from earlier turns); then the token-id path cannot reproduce the template and must not pretend to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.contract import HIT, MISS_BELOW_THRESHOLD, MISS_MISMATCH, common_prefix_length

#: ``tokenize(messages=None, prompt=None, *, add_generation_prompt, add_special_tokens) -> ids``:
#: a chat-template render of ``messages`` (or a plain encode of ``prompt``) as the server does it.
TokenizeFn = Callable[..., list[int]]

_PROBE = "ok"


class TemplateJoinError(ValueError):
    """The chat template does not render a history as prompt + reply + joiner + new messages."""


@dataclass(frozen=True)
class TurnJoiner:
    """The ids that glue a finished assistant turn to the next rendered messages.

    Attributes:
        end_of_turn_ids: what the template puts right after an assistant reply's content (ChatML:
            ``[<|im_end|>]``); appended when the generated ids do not already end with it.
        separator_ids: what follows the end-of-turn before the next message (ChatML: ``["\\n"]``;
            empty for templates such as Llama 3's).
        generation_prompt_ids: what ``add_generation_prompt`` appends (ChatML:
            ``<|im_start|>assistant\\n``); used to cut it off a rendered assistant message.
    """

    end_of_turn_ids: tuple[int, ...]
    separator_ids: tuple[int, ...]
    generation_prompt_ids: tuple[int, ...]


def next_prompt_ids(
    prev_prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    new_message_ids: Sequence[int],
    joiner: TurnJoiner,
) -> list[int]:
    """The next turn's prompt ids on the token-id path (pure).

    Args:
        prev_prompt_ids: the previous turn's prompt ids, as the server reported them.
        generated_ids: the ids the server generated for it (may end with the end-of-turn id).
        new_message_ids: the ids of the newly appended messages rendered alone by the chat template
            with ``add_generation_prompt=True`` and ``add_special_tokens=False``.
        joiner: the template's glue (see :func:`calibrate_joiner`).

    Returns:
        ``prev + generated + eot (unless generated ends with it) + separator + new``; a new list.
    """
    eot = list(joiner.end_of_turn_ids)
    gen = list(generated_ids)
    out = list(prev_prompt_ids) + gen
    if not (eot and len(gen) >= len(eot) and gen[-len(eot):] == eot):
        out += eot
    out += joiner.separator_ids
    out += new_message_ids
    return out


def strip_generation_prompt(rendered_ids: Sequence[int], joiner: TurnJoiner) -> list[int]:
    """Cut the generation prompt off the front of an assistant message rendered alone.

    Used when a reply must be re-entered as ids without having been generated (a failed turn is
    replaced by the trace's reply): ``render([reply, *new], add_generation_prompt=True)`` starts
    with the role header the previous prompt already ends with.

    Raises:
        TemplateJoinError: ``rendered_ids`` does not start with the generation prompt.
    """
    g = list(joiner.generation_prompt_ids)
    if list(rendered_ids[: len(g)]) != g:
        raise TemplateJoinError(
            f"rendered assistant message does not start with the generation prompt ids {g}: "
            f"{list(rendered_ids[: len(g) + 4])}..."
        )
    return list(rendered_ids[len(g):])


def calibrate_joiner(tokenize: TokenizeFn) -> TurnJoiner:
    """Derive the :class:`TurnJoiner` of a chat template from five ``tokenize`` calls.

    With u = a user message "ok", a = an assistant message "ok", it renders ``A = [u]+gen``,
    ``A0 = [u]``, ``F = [u, a, u]+gen``, ``N = [u]+gen`` (no special tokens) and encodes ``Y = "ok"``,
    then requires ``F == A + Y + J + N`` and ``A == A0 + G``. The first id of ``J`` is the
    end-of-turn, the rest the separator; ``G`` is the generation prompt.

    Raises:
        TemplateJoinError: the renders do not decompose that way (message says which part).
    """
    u = {"role": "user", "content": _PROBE}
    a = {"role": "assistant", "content": _PROBE}
    A = tokenize(messages=[u], add_generation_prompt=True, add_special_tokens=False)
    A0 = tokenize(messages=[u], add_generation_prompt=False, add_special_tokens=False)
    F = tokenize(messages=[u, a, u], add_generation_prompt=True, add_special_tokens=False)
    N = tokenize(messages=[u], add_generation_prompt=True, add_special_tokens=False)
    Y = tokenize(prompt=_PROBE, add_special_tokens=False)
    if A[: len(A0)] != A0 or len(A) <= len(A0):
        raise TemplateJoinError(
            f"the render with add_generation_prompt ({A}) does not extend the one without ({A0})"
        )
    G = A[len(A0):]
    head = A + Y
    if F[: len(head)] != head:
        raise TemplateJoinError(
            f"the render of [user, assistant, user] ({F}) does not start with the turn-1 prompt plus "
            f"the reply's ids ({head}); the template re-renders earlier turns"
        )
    if len(F) < len(head) + len(N) or F[len(F) - len(N):] != N:
        raise TemplateJoinError(
            f"the render of [user, assistant, user] ({F}) does not end with the new message rendered "
            f"alone ({N}); the template adds context to a lone message (e.g. a default system prompt)"
        )
    J = F[len(head): len(F) - len(N)]
    if not J:
        raise TemplateJoinError(f"no end-of-turn ids between the reply and the next message in {F}")
    return TurnJoiner(end_of_turn_ids=tuple(J[:1]), separator_ids=tuple(J[1:]), generation_prompt_ids=tuple(G))


def reuse_against(prev_span: Sequence[int], prompt_ids: Sequence[int]) -> tuple[int, int | None]:
    """Expected reusable tokens and divergence position of a prompt against the previous span.

    Args:
        prev_span: previous turn's prompt ids + generated ids (what the decode worker holds KV for,
            plus the last sampled token).
        prompt_ids: this turn's rendered prompt ids.

    Returns:
        ``(lcp, divergence)``: the longest common prefix in tokens, and the first index where the
        two differ, or None when the prompt contains the whole previous span. A prompt that ends
        inside the span (a retry resends the previous prompt) diverges where it ends.
    """
    lcp = common_prefix_length(prev_span, prompt_ids)
    return lcp, (None if lcp >= len(prev_span) else lcp)


@dataclass(frozen=True)
class ReuseOracle:
    """What a correct P/D stack with a live handle can reuse for one turn (the turn-N oracle).

    All counts are tokens, computed from rendered ids only (never from message equality).

    Attributes:
        lcp: longest common prefix of the previous span (prompt + generated ids) and this prompt.
        divergence: first differing position, or None (see :func:`reuse_against`).
        handle_tokens: tokens the decode worker holds KV for: previous prompt + generated - 1 (the
            last sampled token was never fed back, so it has no KV).
        usable_tokens: what the handle may offer: all ``handle_tokens`` when this prompt starts with
            them; otherwise only the whole blocks before the divergence
            (``floor(lcp / block_size) * block_size``, docs/design.md: trimming), 0 when none is left.
        reusable_tokens: whole blocks of reusable KV: ``floor(min(usable, prompt - 1) / block_size) *
            block_size`` (a prefill computes at least the last prompt token); for a plain
            continuation ``floor((P + G - 1) / block_size) * block_size``.
        remote_tokens: what a pull moves, vLLM's rule (``pull_scheduler.get_num_new_matched_tokens``):
            ``min(usable, prompt) - local_cached``, at least 0.
        outcome: the reuse outcome a correct proxy reports for a live, unexpired handle:
            ``miss_mismatch`` (no usable token: the ids diverge inside the first block),
            ``miss_below_threshold`` (fewer than ``threshold`` tokens beyond P's own prefix-cache
            hit; 0 included: P already has them), else ``hit``.
    """

    lcp: int
    divergence: int | None
    handle_tokens: int
    usable_tokens: int
    reusable_tokens: int
    remote_tokens: int
    outcome: str


def reuse_oracle(prev_prompt_ids: Sequence[int], generated_ids: Sequence[int], prompt_ids: Sequence[int], *,
                 block_size: int, local_cached_tokens: int = 0, threshold: int = 64) -> ReuseOracle:
    """The turn-N oracle for a prompt following ``prev_prompt_ids`` + ``generated_ids`` (pure).

    Args:
        prev_prompt_ids: the previous turn's prompt ids as the server rendered them.
        generated_ids: the ids it generated.
        prompt_ids: this turn's prompt ids as rendered.
        block_size: KV block size of the workers, tokens (vLLM CPU: 128; GPU: 16 by default).
        local_cached_tokens: P's own prefix-cache hit for this prompt, tokens (whole blocks; with
            prefix caching on P it is the whole blocks of the previous prompt that this one keeps).
        threshold: the connector's ``kv_recompute_threshold``, tokens (default 64).

    Returns:
        :class:`ReuseOracle`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    span = list(prev_prompt_ids) + list(generated_ids)
    lcp, div = reuse_against(span, prompt_ids)
    handle = max(len(span) - 1, 0)
    usable = handle if lcp >= handle else lcp // block_size * block_size
    reusable = min(usable, max(len(prompt_ids) - 1, 0)) // block_size * block_size
    remote = max(min(usable, len(prompt_ids)) - local_cached_tokens, 0)
    if usable == 0:
        outcome = MISS_MISMATCH
    elif remote < threshold:
        outcome = MISS_BELOW_THRESHOLD
    else:
        outcome = HIT
    return ReuseOracle(lcp=lcp, divergence=div, handle_tokens=handle, usable_tokens=usable,
                       reusable_tokens=reusable, remote_tokens=remote, outcome=outcome)
