"""Time one decoder layer's prefill of a model's shape, for a cost profile's prefill curve c(x).

Where vLLM cannot run (a lent GPU machine that has PyTorch but no vLLM), this measures what the
planner's profile needs of prefill (docs/planner/profiles.md): one decoder
layer of the model's shape (``planner.layer_shape``, from its config.json) with random
weights, run forward over ``x`` tokens from scratch with PyTorch's fused causal attention
(``torch.nn.functional.scaled_dot_product_attention``), for a few ``x``. The median of
``--repeats`` timings per length (CUDA events on a GPU, ``time.perf_counter`` around a
synchronised call elsewhere) goes to a JSON file; ``turnscope profile-from-timing`` fits
c(x) = a1 x + a2 x^2 to it, scales by the layer count and writes a profile that says which
figures it measured.

Needs only PyTorch (2.5 or later for grouped KV heads in one call; older versions repeat the KV
heads) and this repository's ``planner/layer_shape.py``. What it does not time: the
embedding and LM head, tensor parallelism's two all-reduces per layer, vLLM's scheduler and paged
KV writes, and chunked prefill's split of a long prompt (the same FLOPs in several passes).

    python bench/layer_prefill.py --config tests/data/model_configs/Qwen3-32B.json --tp 8 \\
        --tokens 1024,4096,16384,32768 --out layer.json      # on a GPU: bf16, CUDA

Exit status 2 with a message naming the file and field for a config it cannot time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.layer_shape import (
    LAYER_TIMING_FORMAT,
    DecoderLayerShape,
    LayerShapeError,
)


def build_layer(shape: DecoderLayerShape, dtype, device, seed: int = 0) -> dict:
    """Random weights of ``shape`` (normal, std 0.02 as Hugging Face initialises Llama), as a dict
    of tensors on ``device``: matrices stored (in, out) so a forward is ``x @ w``."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)

    def weight(*size):
        return (torch.randn(*size, generator=g) * 0.02).to(dtype=dtype, device=device)

    w = {"q": weight(shape.hidden, shape.q_width), "k": weight(shape.hidden, shape.kv_width),
         "v": weight(shape.hidden, shape.kv_width), "o": weight(shape.q_width, shape.hidden),
         "gate": weight(shape.hidden, shape.intermediate), "up": weight(shape.hidden, shape.intermediate),
         "down": weight(shape.intermediate, shape.hidden),
         "norm1": torch.ones(shape.hidden, dtype=dtype, device=device),
         "norm2": torch.ones(shape.hidden, dtype=dtype, device=device)}
    if shape.qk_norm:
        w["q_norm"] = torch.ones(shape.head_dim, dtype=dtype, device=device)
        w["k_norm"] = torch.ones(shape.head_dim, dtype=dtype, device=device)
    return w


def _rms_norm(x, weight, eps: float = 1e-6):
    import torch

    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _rope(x, cos, sin):
    """Rotary position embedding, the half-split form of Llama's ``rotate_half``."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def layer_forward(w: dict, shape: DecoderLayerShape, x, cos, sin):
    """One decoder layer over ``x`` of shape (1, tokens, hidden): pre-norm attention with causal
    masking and grouped KV heads, then the gated SiLU MLP; returns a tensor of ``x``'s shape."""
    import torch.nn.functional as F

    n = x.shape[1]
    h = _rms_norm(x, w["norm1"])
    q = (h @ w["q"]).view(1, n, shape.heads, shape.head_dim)
    k = (h @ w["k"]).view(1, n, shape.kv_heads, shape.head_dim)
    v = (h @ w["v"]).view(1, n, shape.kv_heads, shape.head_dim)
    if shape.qk_norm:
        q, k = _rms_norm(q, w["q_norm"]), _rms_norm(k, w["k_norm"])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    try:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=shape.kv_heads != shape.heads)
    except TypeError:  # PyTorch < 2.5: no enable_gqa
        group = shape.heads // shape.kv_heads
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           is_causal=True)
    x = x + a.transpose(1, 2).reshape(1, n, shape.q_width) @ w["o"]
    h = _rms_norm(x, w["norm2"])
    return x + (F.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def rope_tables(tokens: int, head_dim: int, dtype, device, theta: float):
    """cos and sin of the rotary angles for positions 0..tokens-1, shaped (1, 1, tokens, head_dim)."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32, device=device), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


class LayerTimer:
    """Times :func:`layer_forward` of one shape on one device: ``time(tokens)`` returns the
    per-repeat seconds of a prefill of ``tokens`` tokens from scratch (after ``warmup`` untimed
    calls)."""

    def __init__(self, shape: DecoderLayerShape, dtype, device, theta: float = 10000.0,
                 repeats: int = 5, warmup: int = 2) -> None:
        import torch

        self.shape, self.dtype, self.device, self.theta = shape, dtype, torch.device(device), theta
        self.repeats, self.warmup = repeats, warmup
        self.weights = build_layer(shape, dtype, self.device)

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, tokens: int) -> list[float]:
        import torch

        g = torch.Generator(device="cpu").manual_seed(tokens)
        x = torch.randn(1, tokens, self.shape.hidden, generator=g).to(dtype=self.dtype, device=self.device)
        cos, sin = rope_tables(tokens, self.shape.head_dim, self.dtype, self.device, self.theta)
        samples: list[float] = []
        with torch.inference_mode():
            for i in range(self.warmup + self.repeats):
                if self.device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    layer_forward(self.weights, self.shape, x, cos, sin)
                    end.record()
                    self._sync()
                    seconds = start.elapsed_time(end) / 1000.0
                else:
                    self._sync()
                    t0 = time.perf_counter()
                    layer_forward(self.weights, self.shape, x, cos, sin)
                    self._sync()
                    seconds = time.perf_counter() - t0
                if i >= self.warmup:
                    samples.append(seconds)
        return samples


def device_name(device) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``) or the CPU's."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def rope_theta(cfg: dict) -> float:
    """The rotary base of a config.json: ``rope_theta`` (transformers 4) or
    ``rope_parameters.rope_theta`` (transformers 5); 10,000 (Llama's default) when neither is set.
    Scaled RoPE variants (``rope_type`` llama3, yarn) change the angles, not the cost."""
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def measure(config_path: Path, tp: int, tokens: list[int], dtype_name: str, device: str,
            repeats: int, warmup: int) -> dict:
    """Time the layer of ``config_path`` at each length of ``tokens``; the JSON document
    ``turnscope profile-from-timing`` reads (format ``LAYER_TIMING_FORMAT``).

    Raises:
        LayerShapeError: a config that cannot be timed (named file and field).
    """
    import torch

    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LayerShapeError(f"{config_path}: cannot read the model's config.json: {e}") from e
    shape = DecoderLayerShape.from_config(cfg, tp=tp, where=str(config_path))
    text = cfg.get("text_config", cfg)
    timer = LayerTimer(shape, getattr(torch, dtype_name), device, rope_theta(text), repeats=repeats, warmup=warmup)
    points = []
    for n in tokens:
        samples = timer.time(n)
        points.append({"tokens": n, "layer_s": statistics.median(samples), "samples_s": samples})
    # timezone.utc, not datetime.UTC: a GPU image's Python may be older than 3.11
    return {"format": LAYER_TIMING_FORMAT, "config": str(config_path), "model_type": text.get("model_type", ""),
            "shape": asdict(shape), "dtype": dtype_name, "device": device_name(device),
            "torch": torch.__version__, "attention": "torch.nn.functional.scaled_dot_product_attention",
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
            "points": points}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="The model's config.json.")
    parser.add_argument("--tp", type=int, default=1, help="Tensor-parallel GPUs per worker (default 1).")
    parser.add_argument("--tokens", default="1024,4096,16384,32768",
                        help="Comma-separated prompt lengths to time (default %(default)s).")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="bfloat16 on CUDA, float32 elsewhere (default).")
    parser.add_argument("--device", default=None, help="cuda when available, else cpu (default).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per length (default 5).")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed calls first (default 2).")
    parser.add_argument("--out", type=Path, required=True, help="Where to write the JSON timings.")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: this PyTorch sees no CUDA device")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if len(set(tokens)) < 2 or min(tokens) <= 0:
        parser.error("--tokens: at least two distinct positive lengths are needed to fit a1 and a2")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    if not args.out.parent.is_dir():  # checked before the timing, so that no measurement is lost
        parser.error(f"--out {args.out}: folder {args.out.parent} does not exist")
    try:
        doc = measure(args.config, args.tp, tokens, dtype, device, args.repeats, args.warmup)
    except LayerShapeError as e:
        print(f"layer_prefill: {e}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    for p in doc["points"]:
        print(f"{p['tokens']:>8} tokens: {p['layer_s'] * 1e3:9.3f} ms per layer, "
              f"{p['layer_s'] * doc['shape']['layers'] * 1e3:10.1f} ms for {doc['shape']['layers']} layers")
    print(f"wrote {args.out} ({doc['device']}, {dtype}, tp {args.tp})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
