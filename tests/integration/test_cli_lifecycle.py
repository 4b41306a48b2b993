"""What `turnscope serve` and `turnscope dashboard` leave behind when stopped, and how they fail
when another instance holds their ports: SIGTERM (systemd, docker, `kill`) stops every process
they started, as Ctrl-C does; a port that is taken, or taken by an instance that started moments
earlier, is a non-zero exit and never a claim of serving.

Truths: the operating system's process table and listening sockets (psutil), exit codes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from serving.workers import port_in_use
from tests.integration.test_bad_input import _embedded_topology_file
from tests.integration.test_security import listening, spawn, stop
from tests.integration.vllm_stack import free_port

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "turnscope"]


def tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def gone(procs: list[psutil.Process], timeout_s: float = 60.0) -> list[psutil.Process]:
    """The processes of `procs` still alive after `timeout_s` seconds."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} within {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_dashboard_stops_with_sigterm_and_refuses_a_taken_port(tmp_path):
    port = free_port()
    log = tmp_path / "dash.log"
    proc = spawn([*CLI, "dashboard", "--store", str(tmp_path / "store"), "--port", str(port)], log)
    try:
        listening(proc.pid, port)
        procs = tree(proc.pid)
        assert len(procs) >= 2  # turnscope and streamlit
        # a second dashboard on the same port says so and exits non-zero
        second = subprocess.run([*CLI, "dashboard", "--store", str(tmp_path / "store"), "--port", str(port)],
                                check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
                                env=os.environ | {"COLUMNS": "4000"})
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"port {port} on 127.0.0.1 is already in use" in " ".join(second.stdout.split())
        proc.send_signal(signal.SIGTERM)
        assert gone(procs, 30) == []
        assert not port_in_use("127.0.0.1", port)
    finally:
        if proc.poll() is None:
            stop(proc)


@pytest.mark.vllm
def test_serve_stops_its_workers_on_sigterm_and_a_racing_second_instance_fails(tmp_path):
    """Two `serve --mode aggregated` started a second apart on the same ports: exactly one serves;
    the other finds the ports claimed by the first (``serving.port_claims``) and exits non-zero
    within seconds, before loading a model and never claiming to serve; SIGTERM to the survivor
    stops its worker and proxy and frees every port."""
    topo, ports = _embedded_topology_file(tmp_path)
    argv = [*CLI, "serve", "--topology", str(topo), "--mode", "aggregated"]
    logs = [tmp_path / "serve-a.log", tmp_path / "serve-b.log"]
    started = time.monotonic()
    first = spawn([*argv, "--log-dir", str(tmp_path / "logs-a")], logs[0])
    time.sleep(1.0)
    second = spawn([*argv, "--log-dir", str(tmp_path / "logs-b")], logs[1])
    procs = [first, second]
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        losers = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert len(losers) == 1, [log.read_text()[-2000:] for log in logs]
        loser, winner = losers[0], 1 - losers[0]
        assert procs[loser].returncode != 0
        assert time.monotonic() - started < 90, "the loser loaded a model before failing"
        assert "already claimed by another turnscope" in " ".join(logs[loser].read_text().split())
        assert "serving through the proxy" not in logs[loser].read_text(), logs[loser].read_text()[-3000:]
        wait_for(logs[winner], "serving through the proxy", procs[winner], 400)
        # every worker reports its own prefix-cache hit (--enable-prompt-tokens-details): the second
        # of two prompts sharing 300 tokens finds those tokens' 2 whole 128-token blocks cached
        ids = list(range(100, 400))
        cached = []
        for tail in ([7] * 20, [9] * 20):
            r = httpx.post(f"http://127.0.0.1:{ports['proxy']}/v1/completions", timeout=120, json={
                "model": "turnscope-tiny", "prompt": ids + tail, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            cached.append((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"))
        assert cached == [0, 256], cached
        serving = tree(procs[winner].pid)
        assert len(serving) >= 3  # turnscope, the vLLM worker (and its engine), the proxy
        procs[winner].send_signal(signal.SIGTERM)
        assert gone(serving, 90) == [], [p.cmdline()[:4] for p in serving if p.is_running()]
        assert procs[winner].returncode is not None or procs[winner].wait(5) is not None
        assert not any(port_in_use("127.0.0.1", ports[k]) for k in ("a", "proxy"))
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)
