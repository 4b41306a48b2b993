"""P's own prefix cache replayed block by block as vLLM 0.32 keeps it, over a run's recorded turns:
the yardstick that says how much of the planner's P hit-rate error (docs/eviction.md) comes from
the planner's simpler cache.

The planner (:func:`planner.simulate.own_cache_hits`) keeps, per worker, an LRU of
*sessions*, each holding its last prompt whole; a session is evicted whole, the system prompt all
sessions share is held outside the LRU's accounting, and requests still running take no room.
vLLM's KV cache manager (``vllm/v1/core/kv_cache_manager.py``, ``block_pool.py``,
``kv_cache_utils.py: FreeKVCacheBlockQueue``) keeps *blocks*:

* a request's prompt is looked up block by block; its hit is the leading whole blocks found,
  at most the prompt less its last token (``get_computed_blocks``: ``max_cache_hit_length =
  num_tokens - 1``);
* its blocks are held (not evictable) while it runs; on P that is until D has read them
  (NixlConnector's producer side), here: from the turn's send to its first token;
* when it finishes, its blocks are freed to the tail of the free queue *in reverse order*
  (``free_blocks(reversed(...))``), so a freed prompt's last blocks are evicted first and its
  first blocks last: an evicted session keeps a partial prefix;
* a new block is taken from the head of the free queue (least recently freed), evicting the
  cached block it held; a hit takes its blocks out of the queue (``touch``);
* the shared system prompt's whole blocks are ordinary blocks, shared by every session.

The replay is this policy at request granularity (a request's blocks are allocated at its send,
freed at its first token), on ``capacity_blocks`` blocks (vLLM's ``num_gpu_blocks`` less the null
block it reserves), one worker, starting empty (each run has its own prefix-cache salt: what
earlier runs left is never hit, and as the least recently freed it is evicted first).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pandas as pd


def replay_hits(turns: pd.DataFrame, capacity_blocks: int, block_size: int, shared_prefix_tokens: int = 0,
                hold_until: str = "ttft_s") -> np.ndarray:
    """Each turn's hit in P's own prefix cache (tokens), replayed as the module doc says.

    ``turns``: one run's turns with ``session_id``, ``turn_index``, ``sent_s`` (seconds on any
    clock), ``prompt_tokens`` and the column ``hold_until`` names (seconds after the send the
    request holds its blocks: ``ttft_s`` for P). Each session's prompts extend its previous one
    (history sent as token ids), so a session's block j is the same block at every turn that has
    it, unless ``turns`` has a column ``reusable_tokens`` (tokens of the prompt that are a prefix of
    the session's previous turn, its ``shared_prefix_tokens``): then a block from
    ``reusable_tokens // block_size`` on is new content (an edited history), never found cached.
    The first ``shared_prefix_tokens`` (the system prompt) are the same for every session.
    Returns the hits in ``turns``' row order.

    Raises:
        ValueError: ``capacity_blocks`` or ``block_size`` below 1.
    """
    if capacity_blocks < 1 or block_size < 1:
        raise ValueError(f"capacity_blocks and block_size must be >= 1, got {capacity_blocks} and {block_size}")
    shared_blocks = shared_prefix_tokens // block_size
    order = np.argsort(turns["sent_s"].to_numpy(float), kind="stable")
    sessions = turns["session_id"].astype(str).to_numpy()
    sent = turns["sent_s"].to_numpy(float)
    prompt = turns["prompt_tokens"].to_numpy(int)
    hold = np.nan_to_num(turns[hold_until].to_numpy(float), nan=0.0)
    hits = np.zeros(len(turns), dtype=np.int64)
    reusable = (turns["reusable_tokens"].to_numpy(np.int64) if "reusable_tokens" in turns
                else np.full(len(turns), np.iinfo(np.int64).max))
    version: dict[str, list[int]] = {}     # session -> the turn that last wrote each of its blocks

    cached: set = set()                     # keys with a block holding them (free or in use)
    free: OrderedDict = OrderedDict()       # key (or an anonymous block) -> None; head = evicted next
    in_use: dict = {}                       # key -> reference count
    free_anonymous = capacity_blocks        # never-used blocks, taken before any cached one
    running: list[tuple[float, int, list]] = []   # (release time, turn, its block keys in order)

    def key(s: str, j: int):
        return ("shared", j) if j < shared_blocks else (s, version[s][j], j)

    def release_until(t: float) -> None:
        nonlocal running
        done = sorted((r for r in running if r[0] <= t), key=lambda r: (r[0], r[1]))
        running = [r for r in running if r[0] > t]
        for _, _, keys in done:
            for k in reversed(keys):        # freed in reverse: the prompt's tail is evicted first
                in_use[k] -= 1
                if in_use[k] == 0:
                    del in_use[k]
                    free[k] = None

    def take_block() -> bool:
        nonlocal free_anonymous
        if free_anonymous > 0:
            free_anonymous -= 1
            return True
        if not free:
            return False                    # every block is in use: vLLM would make it wait
        old, _ = free.popitem(last=False)
        cached.discard(old)
        return True

    for i in order:
        release_until(sent[i])
        s, n = sessions[i], int(prompt[i])
        full = n // block_size
        limit = (n - 1) // block_size       # the last token is always computed
        kept = version.setdefault(s, [])
        same = min(len(kept), full, int(reusable[i] // block_size))
        version[s] = kept[:same] + [int(i)] * (full - same)   # blocks past the shared prefix: new content
        keys = [key(s, j) for j in range(full)]
        h = 0
        while h < limit and keys[h] in cached:
            h += 1
        hits[i] = h * block_size
        for k in keys[:h]:                  # touch: out of the free queue, referenced
            free.pop(k, None)
            in_use[k] = in_use.get(k, 0) + 1
        held = list(keys[:h])
        for k in keys[h:]:
            if k in cached:                 # a later block still cached past a missing one (vLLM computes
                #                                 it again into a new block; reusing it here saves that block)
                free.pop(k, None)
                in_use[k] = in_use.get(k, 0) + 1
                held.append(k)
                continue
            if not take_block():
                break
            cached.add(k)
            in_use[k] = in_use.get(k, 0) + 1
            held.append(k)
        running.append((sent[i] + float(hold[i]), int(i), held))
    return hits


def fifo_starts(sent_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """When each request started on a worker that serves its queue first come, first served, in the
    order the requests ended (seconds): the later of its send and the end of the request that ended
    before it, never after its own end. vLLM looks a request up in its prefix cache and gives it
    blocks when it schedules it, not when it arrives: on a P whose queue is seconds long, what the
    cache holds then is what counts (the replay's send times, :func:`replay_hits`)."""
    sent, end = np.asarray(sent_s, dtype=float), np.asarray(end_s, dtype=float)
    start = np.empty_like(sent)
    busy = -np.inf
    for i in np.argsort(end, kind="stable"):
        start[i] = min(max(sent[i], busy), end[i])
        busy = end[i]
    return start
