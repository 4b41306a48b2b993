"""The NixlConnector settings every part reasons with: :class:`Connector`, read from a topology
file (``serving.topology``) and from the operator's settings (``turnscope.conductor.settings``). Part of the
ground layer: imports only :mod:`core.contract`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.contract import DECODER_KV_BLOCKS_TTL_S, KV_RECOMPUTE_THRESHOLD_TOKENS


class Connector(BaseModel):
    """NixlConnector settings, ``kv_connector_extra_config`` plus transfer-config fields.

    Defaults are vLLM's (docs/features/nixl_connector_usage.md, ``nixl/base_scheduler.py``):
    ``kv_recompute_threshold`` 64 tokens, ``decoder_kv_blocks_ttl`` 480 s, ``kv_lease_duration``
    30 s, ``backends`` ["UCX"] (["LIBFABRIC"] on EFA). ``kv_load_failure_policy`` "recompute"
    (vLLM's default is "fail") makes a failed or declined pull fall back to computing the prompt.
    """

    model_config = ConfigDict(extra="forbid")
    kv_recompute_threshold: int = Field(KV_RECOMPUTE_THRESHOLD_TOKENS, ge=0)
    decoder_kv_blocks_ttl: int = Field(DECODER_KV_BLOCKS_TTL_S, gt=0)
    kv_lease_duration: int = Field(30, gt=0)
    backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1)
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    kv_buffer_device: Literal["cpu", "cuda", "xpu"] | None = None  # default: cpu on CPU, cuda on GPU
