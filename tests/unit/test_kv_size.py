"""KV bytes per token from published config.json files, against hand computations.

The configs under tests/data/model_configs carry the published values (see its README)."""

import json
from pathlib import Path

import pytest

from serving.kv_size import (
    KVSizeError,
    kv_bytes_per_token,
    kv_bytes_per_token_of_config,
    model_kv_bytes_per_token,
)

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"


def test_llama_style_config(tmp_path):
    # Qwen3-32B's published config: 64 layers, 8 KV heads, head_dim 128, bf16 -> 262,144 B/token
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 5120, "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(tmp_path) == 64 * 8 * 128 * 2 * 2 == 262_144


def test_published_qwen3_32b():
    # 64 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 bytes (bf16) = 262,144 bytes per token
    assert model_kv_bytes_per_token(CONFIGS / "Qwen3-32B.json") == 262_144
    # an fp8 KV cache halves it
    assert model_kv_bytes_per_token(CONFIGS / "Qwen3-32B.json", kv_dtype="fp8") == 131_072


def test_unused_sliding_window_is_full_attention():
    # Qwen2.5-32B: sliding_window 131072 but use_sliding_window false; head_dim = 5120 / 40 = 128
    assert model_kv_bytes_per_token(CONFIGS / "Qwen2.5-32B.json") == 64 * 8 * 128 * 2 * 2 == 262_144


def test_mla_deepseek_v3():
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70,272 (no K/V factor 2)
    assert model_kv_bytes_per_token(CONFIGS / "DeepSeek-V3.json") == 61 * 576 * 2 == 70_272
    # vLLM's fp8_ds_mla format: 656 bytes per token and layer
    assert model_kv_bytes_per_token(CONFIGS / "DeepSeek-V3.json", kv_dtype="fp8_ds_mla") == 61 * 656


def test_embedded_model_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 384,
        "torch_dtype": "float32"}))
    assert kv_bytes_per_token(tmp_path) == 4 * 2 * 64 * 2 * 4 == 4096


@pytest.mark.parametrize(("cfg", "field"), [
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
      "sliding_window": 4096}, "sliding_window"),   # Mistral-7B-v0.1
    ({"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
      "layer_types": ["sliding_attention", "full_attention"] * 12}, "layer_types"),  # gpt-oss-20b
    ({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128},
     "index_head_dim"),                              # DeepSeek-V3.2 sparse attention
    ({"num_hidden_layers": 61, "kv_lora_rank": 512}, "qk_rope_head_dim"),
    ({"num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "torch_dtype": "int4"}, "dtype"),
])
def test_refused_layouts_name_the_field(cfg, field):
    with pytest.raises(KVSizeError, match=field):
        kv_bytes_per_token_of_config(cfg, where="m/config.json")


def test_unreadable_files(tmp_path):
    assert kv_bytes_per_token(tmp_path) is None
    with pytest.raises(KVSizeError, match="config.json"):
        model_kv_bytes_per_token(tmp_path)
    (tmp_path / "config.json").write_text("{\n  \"num_hidden_layers\": ,\n}")
    with pytest.raises(KVSizeError, match="line 2"):
        model_kv_bytes_per_token(tmp_path)
