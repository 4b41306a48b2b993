"""The shape of one dense decoder layer of a model, from its Hugging Face ``config.json``: what
``bench/layer_prefill.py`` builds with random weights to time a prefill, and the parameter and FLOP
counts that say what that timing should be near.

Llama-style layers (Llama, Qwen2/2.5/3, Mistral without a sliding window): RMSNorm, Q/K/V
projections (Qwen3 adds an RMSNorm over each head's query and key), scaled dot-product attention
with grouped KV heads, the output projection, RMSNorm and a gated MLP (gate, up, down).

Tensor parallelism of ``tp`` GPUs (Megatron-LM, Shoeybi et al. 2019, section 3: attention split by
heads, the MLP's first matrices by columns and the last by rows) gives each GPU ``heads / tp``
query heads, ``max(1, kv_heads / tp)`` KV heads (vLLM replicates KV heads when there are fewer than
``tp``: vllm/model_executor/layers/linear.py ``QKVParallelLinear``) and ``intermediate / tp`` of
the MLP. The two all-reduces per layer are not part of the shape (nor of the timing). The MLP is
timed SiLU-gated whatever ``hidden_act`` says (an elementwise op: its cost is not the layer's).

Refused, with :class:`LayerShapeError` naming the file and field: mixture-of-experts layers
(``num_experts``, ``num_local_experts``, ``n_routed_experts``: a token's cost depends on routing),
multi-head latent attention (``kv_lora_rank``), sliding-window and hybrid layers (``serving.kv_size.windowed_layers``, as
:mod:`serving.kv_size` refuses them), query heads or MLP width that ``tp`` does not divide, KV
heads and ``tp`` neither of which divides the other, and a missing ``head_dim`` that the width
does not give. Q/K/V biases (Qwen2) are left out of the shape: one addition per output.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.kv_size import positive_int_field, windowed_layers

#: The JSON format ``bench/layer_prefill.py`` writes and :mod:`planner.layer_timing` reads.
LAYER_TIMING_FORMAT = "turnscope-layer-timing/1"

_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class LayerShapeError(ValueError):
    """A config.json whose decoder layer is not a dense Llama-style layer; names file and field."""


def _positive_int(cfg: dict, name: str, where: str) -> int:
    return positive_int_field(cfg, name, where, LayerShapeError)


@dataclass(frozen=True)
class DecoderLayerShape:
    """One decoder layer as one GPU of ``tp`` holds it (``tp = 1``: the whole layer).

    Sizes are counts of elements: ``hidden`` (model width), ``heads`` and ``kv_heads`` (on this
    GPU), ``head_dim``, ``intermediate`` (this GPU's share of the MLP width); ``layers`` is the
    model's layer count, ``qk_norm`` whether each head's query and key are RMS-normalised (Qwen3).
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    tp: int = 1
    qk_norm: bool = False

    @classmethod
    def from_config(cls, cfg: dict, tp: int = 1, where: str = "config.json") -> DecoderLayerShape:
        """The layer of ``cfg`` (a parsed config.json; a multimodal model's ``text_config`` is
        used when present) split over ``tp`` GPUs.

        Raises:
            LayerShapeError: see the module doc; the message names ``where`` and the field.
        """
        cfg = cfg.get("text_config", cfg)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise LayerShapeError(f"{where}: tensor parallelism must be a positive integer, got {tp!r}")
        for name in _MOE_FIELDS:
            if cfg.get(name):
                raise LayerShapeError(f"{where}: field {name!r}: mixture-of-experts layers are not timed (a "
                                      "token's cost depends on its routing); only dense layers are")
        if cfg.get("kv_lora_rank"):
            raise LayerShapeError(f"{where}: field 'kv_lora_rank': multi-head latent attention is not timed; "
                                  "only standard (MHA/GQA/MQA) attention is")
        windowed = windowed_layers(cfg)
        if windowed:
            raise LayerShapeError(f"{where}: {windowed}: only full-attention layers are timed (a sliding-window "
                                  "layer's cost stops growing past the window)")
        hidden = _positive_int(cfg, "hidden_size", where)
        heads = _positive_int(cfg, "num_attention_heads", where)
        kv_heads = _positive_int(cfg, "num_key_value_heads", where) if "num_key_value_heads" in cfg else heads
        if cfg.get("head_dim"):
            head_dim = _positive_int(cfg, "head_dim", where)
        elif hidden % heads:
            raise LayerShapeError(f"{where}: field 'head_dim' is absent and 'hidden_size' = {hidden} is not "
                                  f"divisible by 'num_attention_heads' = {heads}")
        else:
            head_dim = hidden // heads
        intermediate = _positive_int(cfg, "intermediate_size", where)
        layers = _positive_int(cfg, "num_hidden_layers", where)
        for name, count in (("num_attention_heads", heads), ("intermediate_size", intermediate)):
            if count % tp:
                raise LayerShapeError(f"{where}: field {name!r} = {count} is not divisible by tensor "
                                      f"parallelism {tp}")
        if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
            raise LayerShapeError(f"{where}: field 'num_key_value_heads' = {kv_heads} and tensor parallelism {tp}: "
                                  "one must divide the other (vLLM's QKVParallelLinear)")
        qk_norm = str(cfg.get("model_type", "")).startswith("qwen3")
        return cls(hidden=hidden, heads=heads // tp, kv_heads=max(1, kv_heads // tp), head_dim=head_dim,
                   intermediate=intermediate // tp, layers=layers, tp=tp, qk_norm=qk_norm)

    @property
    def q_width(self) -> int:
        """Elements of one token's queries on this GPU (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Elements of one token's keys (or values) on this GPU (KV heads x head_dim)."""
        return self.kv_heads * self.head_dim

    @property
    def matmul_params(self) -> int:
        """Weights of the layer's matrix multiplications on this GPU: Q, K, V, O and the MLP's gate,
        up and down projections (no biases)."""
        attention = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """Every weight of the layer on this GPU: :attr:`matmul_params` plus the two RMSNorms (and
        Qwen3's query and key norms)."""
        return self.matmul_params + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def prefill_flops(self, tokens: int) -> tuple[float, float]:
        """FLOPs of one layer's prefill of ``tokens`` tokens from scratch on this GPU, as
        (matrix multiplications, attention): 2 FLOPs per weight and token (Kaplan et al. 2020,
        "Scaling Laws for Neural Language Models", Table 1), and for causal attention QK^T and AV
        over the ``tokens (tokens + 1) / 2`` query-key pairs, 2 x 2 x head_dim FLOPs each per head.
        """
        pairs = tokens * (tokens + 1) / 2
        return 2.0 * self.matmul_params * tokens, 4.0 * self.q_width * pairs
