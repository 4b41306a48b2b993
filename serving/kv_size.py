"""KV-cache bytes per token of a model, from its Hugging Face ``config.json``.

bytes/token = layers x KV heads x head dim x 2 (K and V) x dtype bytes: the per-token share of
vLLM's ``AttentionSpec.page_size_bytes`` (``2 * block_size * num_kv_heads * head_size *
dtype_size`` per layer, vllm/v1/kv_cache_interface.py). Models with MLA or sliding windows need
their own formula; for those this returns None rather than a wrong number.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}


def kv_bytes_per_token(model_dir: str | Path, kv_dtype: str | None = None) -> int | None:
    """Bytes of KV one token occupies across all layers, or None when ``model_dir`` has no usable
    ``config.json`` (attach mode with a remote path, MLA, sliding-window layers)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("kv_lora_rank") or cfg.get("sliding_window") or cfg.get("layer_types"):
        return None
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError):
        return None
    dtype = kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        return None
    return layers * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype]
