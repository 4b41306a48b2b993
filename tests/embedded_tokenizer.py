"""The embedded model's tokenizer.json for tests: the built model's, or trained into a temp dir.

``serving.embedded_model.build_tokenizer`` is deterministic (same corpus, same spec), so the file
is the one the embedded vLLM workers serve.
"""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def tokenizer_json() -> Path:
    """Path of the embedded tokenizer.json (built once per test process when missing)."""
    built = REPO / "data" / "models" / "turnscope-tiny" / "tokenizer.json"
    if built.exists():
        return built
    from serving.embedded_model import ModelSpec, build_tokenizer

    d = Path(tempfile.mkdtemp(prefix="turnscope-tok-"))
    build_tokenizer(d, ModelSpec())
    return d / "tokenizer.json"
