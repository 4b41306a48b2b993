"""The embedded default model: a tokenizer and a small Llama-style model generated locally.

No hub access exists on the machines turnscope targets, so the model is made here (docs/design.md):

* a byte-level BPE tokenizer trained with `tokenizers` on the text of the shipped tau-bench
  trace (``data/traces/gpt-4o-airline.json``, MIT), with ChatML special tokens and a chat
  template, so the replayed conversations tokenize compactly and deterministically;
* a ``LlamaForCausalLM`` with random weights (fixed seed), saved as float32 safetensors so that
  greedy outputs are reproducible and comparable across serving modes.

The size is chosen so that prefill of a few thousand tokens costs clearly more on 2 CPU cores
than pulling the same KV over NIXL (docs/results.md has the measured numbers), and so that the
KV bytes per token (``kv_bytes_per_token``) make a small ``VLLM_CPU_KVCACHE_SPACE`` hold only
tens of thousands of tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from core import resources

#: Where ``turnscope model`` writes it by default: ``models/`` of turnscope's home (the checkout's
#: ``data/``, or ``./turnscope-data`` installed; core.resources).
DEFAULT_MODEL_DIR = resources.home() / "models" / "turnscope-tiny"
DEFAULT_CORPUS = resources.shipped("traces", "gpt-4o-airline.json")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML. Assistant messages without text content (tool calls) render their calls as JSON, so a
# replayed trace's history is kept as text the model sees.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message.get('tool_calls') %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the generated model. Defaults are the embedded default (docs/results.md).

    KV bytes per token = layers x KV heads x head dim x 2 (K and V) x dtype bytes, the formula
    vLLM's own cache sizing uses (``AttentionSpec.page_size_bytes`` / block size).
    """

    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies (all layers, K and V)."""
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2 * dtype_bytes


def _corpus_texts(corpus: Path) -> list[str]:
    """All message texts of a tau-bench trajectory file, in file order."""
    try:
        trajectories = json.loads(corpus.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{corpus}: cannot read the tokenizer corpus: {exc}") from exc
    texts: list[str] = []
    for traj in trajectories:
        for message in traj.get("traj", []):
            if isinstance(message.get("content"), str):
                texts.append(message["content"])
            if message.get("tool_calls"):
                texts.append(json.dumps(message["tool_calls"]))
    if not texts:
        raise ValueError(f"{corpus}: no message texts found (expected tau-bench trajectories with 'traj')")
    return texts


def build_tokenizer(out_dir: Path, spec: ModelSpec, corpus: Path = DEFAULT_CORPUS):
    """Train the byte-level BPE tokenizer and save it (tokenizer.json, config, chat template).

    Returns the ``PreTrainedTokenizerFast``. Deterministic for a given corpus and spec.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: Path = DEFAULT_MODEL_DIR, spec: ModelSpec = ModelSpec(),
                corpus: Path = DEFAULT_CORPUS) -> Path:
    """Generate tokenizer + random-weight Llama model into ``out_dir`` and return it.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer files
    and ``turnscope_model.json`` (the spec, with kv_bytes_per_token). Raises ValueError when the
    corpus cannot be read.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, spec, corpus)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=spec.dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    meta = asdict(spec) | {"kv_bytes_per_token": spec.kv_bytes_per_token, "head_dim": spec.head_dim}
    (out_dir / "turnscope_model.json").write_text(json.dumps(meta, indent=2))
    return out_dir


def ensure_model(out_dir: Path = DEFAULT_MODEL_DIR, spec: ModelSpec = ModelSpec()) -> Path:
    """Build the embedded model unless ``out_dir`` already holds one with the same spec."""
    meta_path = Path(out_dir) / "turnscope_model.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in asdict(spec).items()):
            return Path(out_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return build_model(out_dir, spec)
