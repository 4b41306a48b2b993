"""KV-cache bytes per token of a model, from its Hugging Face ``config.json``.

Standard attention (MHA/GQA/MQA): bytes/token = layers x KV heads x head dim x 2 (K and V) x
dtype bytes, the per-token share of vLLM's ``AttentionSpec.page_size_bytes`` (``2 * block_size *
num_kv_heads * head_size * dtype_size`` per layer, vllm/v1/kv_cache_interface.py).

Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2 and others; the config has
``kv_lora_rank``): each layer caches one compressed latent of ``kv_lora_rank`` plus the decoupled
RoPE key of ``qk_rope_head_dim`` per token, K and V together (DeepSeek-V2 paper, arXiv 2405.04434
section 2.1.3: "(d_c + d_h^R) l elements"; vLLM 0.32 vllm/v1/kv_cache_interface.py: a page holds
``(head_size + head_size_v) * dtype_size`` bytes per token and KV head, and ``MLAAttentionSpec``
has one KV head, ``head_size = kv_lora_rank + qk_rope_head_dim`` and ``head_size_v = 0``).
vLLM's ``fp8_ds_mla`` cache format stores 656 bytes per token and layer instead
(vllm/v1/attention/backends/mla/flashmla_sparse.py); pass ``kv_dtype="fp8_ds_mla"`` for it.

Refused, with :class:`KVSizeError` naming the field: sliding-window attention (``sliding_window``
in use, or ``sliding_attention`` in ``layer_types``: such layers hold only the last window's
tokens, so bytes per token depend on context length), DeepSeek sparse attention's extra indexer
cache (``index_head_dim``), hybrid/linear-attention layers (``layer_types`` other than full
attention), and unknown dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1, "auto": None}
#: Bytes per token and layer of vLLM's ``fp8_ds_mla`` MLA cache (vllm/v1/kv_cache_interface.py).
FP8_DS_MLA_BYTES_PER_LAYER = 656


class KVSizeError(ValueError):
    """A config.json whose KV size cannot be computed; the message names the file and field."""


def positive_int_field(cfg: dict, name: str, where: str, error: type[ValueError] = KVSizeError) -> int:
    """``cfg[name]`` of a config.json, which must be a positive integer.

    Raises:
        error: the field is missing or not a positive integer (the message names ``where`` and it).
    """
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{where}: field {name!r} must be a positive integer, got {value!r}")
    return value


def windowed_layers(cfg: dict) -> str | None:
    """What makes some of ``cfg``'s layers not full attention, as ``field 'sliding_window' = 4096``
    or ``field 'layer_types' has sliding_attention layers``; None when every layer attends to the
    whole context (a ``sliding_window`` with ``use_sliding_window: false`` is not in use)."""
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) is not False:
        return f"field 'sliding_window' = {window}"
    other = sorted({str(t) for t in cfg.get("layer_types") or []} - {"full_attention"})
    return f"field 'layer_types' has {', '.join(other)} layers" if other else None


def _dtype_bytes(dtype: object, where: str) -> int:
    size = DTYPE_BYTES.get(str(dtype)) if dtype is not None else None
    if size is None:
        known = ", ".join(k for k, v in DTYPE_BYTES.items() if v is not None)
        raise KVSizeError(f"{where}: KV dtype {dtype!r} is not one of {known} "
                          "(field 'torch_dtype'/'dtype', or pass kv_dtype)")
    return size


def kv_bytes_per_token_of_config(cfg: dict, kv_dtype: str | None = None, where: str = "config.json") -> int:
    """Bytes of KV one token occupies across all layers of the model ``cfg`` (a parsed
    ``config.json``; a multimodal model's ``text_config`` is used when present).

    ``kv_dtype`` is the KV cache dtype (vLLM ``--kv-cache-dtype``); default: the config's
    ``torch_dtype`` (or ``dtype``), else bfloat16. See the module doc for the formulas and sources.

    Raises:
        KVSizeError: sliding-window or hybrid layers, a sparse-attention indexer, a missing or
            non-positive shape field, or an unknown dtype; the message names ``where`` and the field.
    """
    cfg = cfg.get("text_config", cfg)
    windowed = windowed_layers(cfg)
    if windowed:
        raise KVSizeError(f"{where}: {windowed}: only full-attention layers are modelled (a sliding-window or "
                          "linear layer's KV does not grow per token, so bytes per token depend on context length)")
    if cfg.get("index_head_dim"):
        raise KVSizeError(f"{where}: field 'index_head_dim': DeepSeek sparse attention keeps an indexer cache "
                          "next to the MLA latent; its size is not modelled")
    layers = positive_int_field(cfg, "num_hidden_layers", where)
    dtype = kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if cfg.get("kv_lora_rank"):
        rank = positive_int_field(cfg, "kv_lora_rank", where)
        rope = positive_int_field(cfg, "qk_rope_head_dim", where)
        if dtype == "fp8_ds_mla":
            return layers * FP8_DS_MLA_BYTES_PER_LAYER
        return layers * (rank + rope) * _dtype_bytes(dtype, where)
    heads = positive_int_field(cfg, "num_attention_heads", where)
    kv_heads = positive_int_field(cfg, "num_key_value_heads", where) if cfg.get("num_key_value_heads") else heads
    if cfg.get("head_dim"):
        head_dim = positive_int_field(cfg, "head_dim", where)
    else:
        head_dim = positive_int_field(cfg, "hidden_size", where) // heads
    return layers * kv_heads * head_dim * 2 * _dtype_bytes(dtype, where)


def read_config(model_dir_or_file: str | Path) -> tuple[dict, str]:
    """The parsed ``config.json`` of a model directory (or the file itself) and its path as text.

    Raises:
        KVSizeError: the file is missing or not a JSON object; the message names it.
    """
    path = Path(model_dir_or_file)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as e:
        raise KVSizeError(f"{path}: cannot read the model's config.json: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise KVSizeError(f"{path}: line {e.lineno}: not valid JSON: {e.msg}") from e
    if not isinstance(cfg, dict):
        raise KVSizeError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, str(path)


def model_kv_bytes_per_token(model_dir_or_file: str | Path, kv_dtype: str | None = None) -> int:
    """:func:`kv_bytes_per_token_of_config` of a model directory's (or file's) config.json.

    Raises:
        KVSizeError: as :func:`read_config` and :func:`kv_bytes_per_token_of_config`.
    """
    cfg, where = read_config(model_dir_or_file)
    return kv_bytes_per_token_of_config(cfg, kv_dtype, where)


def kv_bytes_per_token(model_dir: str | Path, kv_dtype: str | None = None) -> int | None:
    """Bytes of KV one token occupies across all layers, or None when ``model_dir`` has no usable
    ``config.json`` (attach mode with a remote path, a refused layout: see
    :func:`model_kv_bytes_per_token` for the reason)."""
    try:
        return model_kv_bytes_per_token(model_dir, kv_dtype)
    except KVSizeError:
        return None
