"""The token guard's added time per turn against history length (within the proxy's overhead
budget: bench/proxy_overhead.py).

Before offering D's handle the proxy needs the new request's rendered ids. Side by side, at
histories of about 1k, 8k, 32k and 128k tokens (the embedded model's tokenizer and chat template;
the in-process tokenizer serves histories longer than the workers' ``max_model_len``):

* **full re-render**: the whole conversation through the chat template and the tokenizer, in
  process (what P's ``/tokenize`` does, without its HTTP hop: a lower bound of the old guard,
  measured through P at about 1.5-1.8 ms per 1,000 tokens), then
  ``fit_handle`` against D's handle (the previous prompt plus its reply);
* **incremental**: ``serving.prompt_render.IncrementalRenderer.render`` from the session's previous
  render plus the new turn (about 120 new tokens: the reply and the next user message), then the
  same ``fit_handle``: the whole guard as the proxy runs it before the prefill leg;
* **incremental, whole text**: the same with the template's message-local split off
  (``renderer.local = None``: the path of a template that reads ``loop`` or ``messages[0]``,
  which renders the whole text and tokenizes only the new tail).

Each cell is the p50 / p99 of ``--repeats`` guards (ms); the incremental ids are checked equal to
the full render's, and the fit to use the whole handle, every time. Target: incremental <= 2 ms
p50 at 128k, flat in history length.
CPU-bound: run it alone on the machine (no other benchmark or vLLM worker at the same time).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.embedded_model import ensure_model
from serving.handles import Handle, fit_handle
from serving.prompt_render import IncrementalRenderer

WORDS = ["the", "flight", "UA123", "leaves", "at", "12:30", "from", "gate", "B7", "and", "the", "refund", "of", "40", "EUR", "was", "booked", "for", "the", "passenger", "ok", "tool", "result", "status", "confirmed", "reservation", "id"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(r: IncrementalRenderer, tokens: int, rng: random.Random) -> list[dict]:
    """A system message and user/assistant turns of ~300 words each, about ``tokens`` tokens."""
    messages = [{"role": "system", "content": text(rng, 200)}]
    pair = [{"role": "user", "content": text(rng, 300)}, {"role": "assistant", "content": text(rng, 300)}]
    per_pair = len(r.full({"messages": pair, "add_generation_prompt": False})[1])
    for _ in range(max(tokens // per_pair, 1)):
        messages += [{"role": "user", "content": text(rng, 300)}, {"role": "assistant", "content": text(rng, 300)}]
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--histories", type=int, nargs="+", default=[1_000, 8_000, 32_000, 128_000])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    r = IncrementalRenderer(ensure_model())
    whole = IncrementalRenderer(ensure_model())
    whole.local = None
    rng = random.Random(15)
    print("| history (tokens) | full re-render + fit p50 / p99 (ms) | incremental + fit p50 / p99 (ms) "
          "| ratio p50 | incremental, whole text p50 / p99 (ms) |")
    print("|---|---|---|---|---|")
    for target in args.histories:
        history = conversation(r, target, rng)
        prev = {"messages": history + [{"role": "user", "content": text(rng, 60)}]}
        reply = {"role": "assistant", "content": text(rng, 60)}
        new = {"messages": prev["messages"] + [reply, {"role": "user", "content": text(rng, 60)}]}
        prev_ids = r.full(prev)[1]
        reply_ids = r.fast.encode(reply["content"] + "<|im_end|>", add_special_tokens=False).ids
        handle = Handle({"remote_num_tokens": len(prev_ids) + len(reply_ids) - 1}, "d",
                        np.array(prev_ids + reply_ids, dtype=np.int64), len(prev_ids) + len(reply_ids) - 1, 0, 1e9)
        times = {"full": [], "inc": [], "whole": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            want = r.full(new)[1]
            fit_full = fit_handle(handle, want, 128)
            times["full"].append(time.perf_counter() - t0)
            for name, renderer in (("inc", r), ("whole", whole)):
                assert renderer.keep("s", prev, prev_ids)
                t0 = time.perf_counter()
                got = renderer.render("s", new)
                fit = fit_handle(handle, got, 128)
                times[name].append(time.perf_counter() - t0)
                assert got is not None and got.tolist() == want, "incremental render differs from the full render"
                assert fit.usable_tokens == fit_full.usable_tokens == handle.num_tokens
        f, i, w = (np.percentile(np.array(times[k]) * 1000, [50, 99]) for k in ("full", "inc", "whole"))
        print(f"| {len(want):,} | {f[0]:.2f} / {f[1]:.2f} | {i[0]:.2f} / {i[1]:.2f} | {f[0] / i[0]:.0f}x "
              f"| {w[0]:.2f} / {w[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
