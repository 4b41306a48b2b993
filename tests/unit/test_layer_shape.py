"""planner.layer_shape: a decoder layer's shape from config.json, checked against the
parameter counts the model cards publish, and the refusals that name their field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.layer_shape import DecoderLayerShape, LayerShapeError

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_qwen3_32b_layers_hold_the_model_cards_parameter_counts():
    """Qwen/Qwen3-32B's model card: 32.8B parameters, 31.2B of them non-embedding."""
    cfg = _config("Qwen3-32B")
    shape = DecoderLayerShape.from_config(cfg)
    non_embedding = shape.params * shape.layers + cfg["hidden_size"]  # + the final norm
    embeddings = 2 * cfg["vocab_size"] * cfg["hidden_size"]  # embed_tokens and lm_head (untied)
    assert shape.qk_norm and (shape.heads, shape.kv_heads, shape.head_dim) == (64, 8, 128)
    assert round(non_embedding / 1e9, 1) == 31.2
    assert round((non_embedding + embeddings) / 1e9, 1) == 32.8


def test_tensor_parallel_shard_is_an_eighth_of_every_projection():
    cfg = _config("Qwen3-32B")
    whole, shard = DecoderLayerShape.from_config(cfg), DecoderLayerShape.from_config(cfg, tp=8)
    assert (shard.heads, shard.kv_heads, shard.intermediate) == (8, 1, 3200)
    assert shard.matmul_params * 8 == whole.matmul_params
    # vLLM replicates KV heads across GPUs when there are fewer than tp: 8 KV heads over 16 GPUs
    assert DecoderLayerShape.from_config(cfg | {"num_attention_heads": 64}, tp=16).kv_heads == 1


def test_prefill_flops_by_hand():
    shape = DecoderLayerShape(hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, layers=3)
    # Q 4x4, K 4x2, V 4x2, O 4x4, MLP 3 x 4x8: 16 + 8 + 8 + 16 + 96 = 144 weights
    assert shape.matmul_params == 144
    matmul, attention = shape.prefill_flops(3)
    assert matmul == 2 * 144 * 3
    assert attention == 4 * 4 * 6  # 4 FLOPs x q width 4 x 6 causal pairs of 3 tokens


def test_dense_config_with_sliding_window_off_is_accepted():
    assert DecoderLayerShape.from_config(_config("Qwen2.5-32B")).layers == 64


@pytest.mark.parametrize("change, field", [
    ({"n_routed_experts": 256}, "n_routed_experts"),
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"sliding_window": 4096, "use_sliding_window": True}, "sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_layers_it_cannot_time_are_refused_naming_the_field(change, field):
    with pytest.raises(LayerShapeError, match=rf"Qwen3-32B\.json: field '{field}'"):
        DecoderLayerShape.from_config(_config("Qwen3-32B") | change, where="Qwen3-32B.json")


def test_deepseek_v3_is_refused():
    with pytest.raises(LayerShapeError, match="kv_lora_rank|experts"):
        DecoderLayerShape.from_config(_config("DeepSeek-V3"))


def test_tensor_parallelism_must_divide_the_heads():
    with pytest.raises(LayerShapeError, match="'num_attention_heads' = 64 is not divisible by tensor parallelism 3"):
        DecoderLayerShape.from_config(_config("Qwen3-32B"), tp=3)


def test_kv_heads_and_tp_must_divide_one_another():
    cfg = _config("Qwen3-32B") | {"num_key_value_heads": 3, "num_attention_heads": 48}
    with pytest.raises(LayerShapeError, match="'num_key_value_heads' = 3 and tensor parallelism 8"):
        DecoderLayerShape.from_config(cfg, tp=8)


def test_a_missing_head_dim_the_width_does_not_give_is_refused():
    cfg = {k: v for k, v in _config("Qwen3-32B").items() if k != "head_dim"} | {"num_attention_heads": 48,
                                                                              "hidden_size": 5000}
    with pytest.raises(LayerShapeError, match="'head_dim' is absent and 'hidden_size' = 5000"):
        DecoderLayerShape.from_config(cfg)
