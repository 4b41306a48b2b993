"""The rules that decide whether a session's KV comes back from the decode worker, as pure
functions shared by the proxy (``serving.proxy``, ``serving.handles``) and the planner
(``planner.simulate``), so a forecast applies exactly the rules a real run applies.

Units: seconds and tokens. Sources (vLLM 0.32's NixlConnector, ``vllm/distributed/kv_transfer/
kv_connector/v1/nixl/``):

* D pins a finished turn's blocks for ``decoder_kv_blocks_ttl`` seconds (default 480,
  ``base_scheduler.py``) and exports ``remote_num_tokens = request.num_computed_tokens``
  (``pull_scheduler.py: request_finished``): the prompt plus the generated tokens less the last
  sampled one, which has no KV yet.
* P pulls ``min(remote_num_tokens, prompt tokens) - local prefix hit`` tokens, unless that count is
  below ``kv_recompute_threshold`` (default 64), in which case it recomputes them
  (``pull_scheduler.py: get_num_new_matched_tokens``).
* P declines a read within ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` = 5 s of D's deadline
  (``pull_worker.py``), so the proxy offers a handle only for ``decoder_kv_blocks_ttl`` minus a
  margin (vLLM's reference multi-turn proxy: 450 s against 480 s).
* A handle is single use (D frees its blocks after the first read; vLLM issue 52234), and only
  whole KV blocks before the first differing token may be pulled (research/retokenization-and-trim.md).
* P frees D's blocks also when it pulls nothing from a handle it was given (below the threshold, or
  all in its own prefix cache): :func:`d_frees_taken_handle`.
"""

from __future__ import annotations

from core.contract import HIT, MISS_BELOW_THRESHOLD

#: P declines a read this close to D's deadline (vLLM ``pull_worker._KV_BLOCKS_EXPIRY_SAFETY_MARGIN``).
P_EXPIRY_SAFETY_MARGIN_S = 5.0


#: The outcomes of a turn after which D frees, at that turn's prefill, the blocks of the handle the
#: turn took (:func:`d_frees_taken_handle`).
D_FREES_TAKEN_HANDLE: tuple[str, ...] = (HIT, MISS_BELOW_THRESHOLD)


def d_frees_taken_handle(outcome: str | None) -> bool:
    """Whether D frees the blocks of the handle a turn took when that turn is prefilled, rather than
    keeping them until ``decoder_kv_blocks_ttl``: after a pull (``hit``), and after
    ``miss_below_threshold`` too. vLLM 0.32 (``nixl/pull_scheduler.py``): P's
    ``get_num_new_matched_tokens`` returns 0 external tokens when the count to pull is below
    ``kv_recompute_threshold`` or not positive, then ``update_state_after_alloc`` still queues the
    request in ``_reqs_need_recv`` with no local blocks ("If remote_blocks and num_external_tokens
    = 0 ... We need to call send_notif in _read_blocks to free the memory on the remote node"), and
    ``nixl/pull_worker.py`` ``_read_blocks`` sends D the completion notification ("Full prefix cache
    hit: do not need to read remote blocks, just notify P worker"; ``_is_turn2_read_expired`` does
    not decline an empty read), on which D frees the blocks as after a read. Any other outcome
    leaves them pinned to the TTL: ``miss_mismatch`` and ``miss_expired`` (the proxy forwards no
    handle), ``miss_transfer_failed``, a session's last turn (None)."""
    return outcome in D_FREES_TAKEN_HANDLE


def proxy_handle_ttl_s(decoder_kv_blocks_ttl_s: float, margin_s: float) -> float:
    """Seconds the proxy offers a handle after its turn finished: D's TTL less the margin.

    Raises ValueError when the result is not positive (the message names both settings)."""
    ttl = decoder_kv_blocks_ttl_s - margin_s
    if ttl <= 0:
        raise ValueError(f"proxy handle TTL must be positive, got {ttl} s (decoder_kv_blocks_ttl "
                         f"{decoder_kv_blocks_ttl_s} s minus the safety margin {margin_s} s)")
    return ttl


def handle_expired(age_s: float, ttl_s: float) -> bool:
    """Whether a handle ``age_s`` seconds old is past the proxy TTL (expired at exactly the TTL)."""
    return age_s >= ttl_s


def p_declines_read(age_s: float, decoder_kv_blocks_ttl_s: float) -> bool:
    """Whether P declines to read D's blocks ``age_s`` seconds after D pinned them (vLLM's 5 s
    safety margin before D's deadline): with a proxy margin below 5 s a handle can be offered and
    still not read."""
    return age_s + P_EXPIRY_SAFETY_MARGIN_S >= decoder_kv_blocks_ttl_s


def whole_block_tokens(tokens: int, block_size: int) -> int:
    """``tokens`` rounded down to whole KV blocks of ``block_size`` tokens.

    Raises ValueError for a non-positive block size."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return (tokens // block_size) * block_size


def blocks_of(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens (the last one partly filled); elementwise on arrays."""
    return -(-tokens // block_size)


def handle_kv_tokens(prompt_tokens: int, output_tokens: int) -> int:
    """Tokens whose KV D holds after a turn (``remote_num_tokens``): prompt plus output less the
    last sampled token; the prompt alone when nothing was generated. Elementwise on integer
    numpy arrays too (the Memory page's what-if replays whole runs at once)."""
    return prompt_tokens + output_tokens - (output_tokens > 0)


def usable_handle_tokens(kv_tokens: int, common_prefix_tokens: int, block_size: int) -> int:
    """Tokens of a handle holding ``kv_tokens`` that the next prompt may pull, when the two share
    their first ``common_prefix_tokens`` ids: all of them when the prompt starts with every id D
    holds KV for, else the whole blocks before the first difference (0: the handle is not used,
    the proxy's ``miss_mismatch``)."""
    if common_prefix_tokens >= kv_tokens:
        return kv_tokens
    return whole_block_tokens(common_prefix_tokens, block_size)


def reachable_tokens(offered_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens D's KV can cover: ``min(remote_num_tokens, prompt tokens)``."""
    return min(offered_tokens, prompt_tokens)


def below_recompute_threshold(count: int, threshold: int) -> bool:
    """vLLM's rule: a pull of ``count`` tokens (beyond P's local hit) is skipped, and the tokens
    recomputed, when ``0 < count < kv_recompute_threshold`` (threshold 0: never)."""
    return threshold > 0 and 0 < count < threshold


def tokens_to_pull(offered_tokens: int, prompt_tokens: int, local_hit_tokens: int, threshold: int) -> int:
    """Tokens P pulls from D: ``min(offered, prompt) - local hit``, or 0 when that is not positive
    or below the recompute threshold."""
    count = reachable_tokens(offered_tokens, prompt_tokens) - local_hit_tokens
    if count <= 0 or below_recompute_threshold(count, threshold):
        return 0
    return count


def local_prefix_tokens(cached_tokens: int, common_prefix_tokens: int, block_size: int,
                        prompt_tokens: int | None = None) -> int:
    """P's own prefix-cache hit: whole blocks of what it holds for the session
    (``cached_tokens``) that the new prompt shares (``common_prefix_tokens``).

    With ``prompt_tokens`` given, never the whole prompt: vLLM recomputes at least the last prompt
    token (``max_cache_hit_length = num_tokens - 1``, vllm/v1/core/kv_cache_manager.py); the
    planner passes it. The proxy's estimate, taken before P reports, passes the tokens its
    per-P prefix index holds of the new prompt (``serving.prefix_index``) as ``cached_tokens``,
    the new prompt's length as ``common_prefix_tokens``, and no cap."""
    limit = min(cached_tokens, common_prefix_tokens)
    if prompt_tokens is not None:
        limit = min(limit, max(prompt_tokens - 1, 0))
    return whole_block_tokens(limit, block_size)
