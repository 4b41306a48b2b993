"""The token guard's added time per turn against history length (issue 15, item 1).

Before offering D's handle the proxy needs the new request's rendered ids. Side by side, at
histories of about 1k, 8k, 32k and 128k tokens (the embedded model's tokenizer and chat template;
the in-process tokenizer serves histories longer than the workers' ``max_model_len``):

* **full re-render**: the whole conversation through the chat template and the tokenizer, in
  process (what P's ``/tokenize`` does, without its HTTP hop: a lower bound of the old guard,
  which issue 15 measured through P at about 1.5-1.8 ms per 1,000 tokens);
* **incremental**: ``serving.prompt_render.IncrementalRenderer.render`` from the session's previous
  render plus the new turn (about 120 new tokens: the reply and the next user message).

Each cell is the p50 / p99 of ``--repeats`` renders (ms); the incremental ids are checked equal to
the full render's every time. Target: incremental <= 2 ms p50 at 128k, flat in history length.
CPU-bound: run under ``flock /work/.cpu-heavy.lock``.
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
    rng = random.Random(15)
    print("| history (tokens) | full re-render p50 / p99 (ms) | incremental p50 / p99 (ms) | ratio p50 |")
    print("|---|---|---|---|")
    for target in args.histories:
        history = conversation(r, target, rng)
        prev = {"messages": history + [{"role": "user", "content": text(rng, 60)}]}
        new = {"messages": prev["messages"] + [{"role": "assistant", "content": text(rng, 60)},
                                               {"role": "user", "content": text(rng, 60)}]}
        full_t, inc_t = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            want = r.full(new)[1]
            full_t.append(time.perf_counter() - t0)
            assert r.keep("s", prev, r.full(prev)[1])
            t0 = time.perf_counter()
            got = r.render("s", new)
            inc_t.append(time.perf_counter() - t0)
            assert got == want, "incremental render differs from the full render"
        f = np.percentile(np.array(full_t) * 1000, [50, 99])
        i = np.percentile(np.array(inc_t) * 1000, [50, 99])
        print(f"| {len(want):,} | {f[0]:.2f} / {f[1]:.2f} | {i[0]:.2f} / {i[1]:.2f} | {f[0] / i[0]:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
