import json

from serving.kv_size import kv_bytes_per_token


def test_llama_style_config(tmp_path):
    # Qwen3-32B's published config: 64 layers, 8 KV heads, head_dim 128, bf16 -> 262,144 B/token
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 5120, "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(tmp_path) == 64 * 8 * 128 * 2 * 2 == 262_144


def test_embedded_model_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 384,
        "torch_dtype": "float32"}))
    assert kv_bytes_per_token(tmp_path) == 4096


def test_unknown_shapes_give_none(tmp_path):
    assert kv_bytes_per_token(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "kv_lora_rank": 512}))
    assert kv_bytes_per_token(tmp_path) is None
