"""Make vLLM's streamed responses carry the decode worker's ``kv_transfer_params``.

With ``bidirectional_kv_xfer`` the decode worker (D) returns, when a request finishes, the
handle that the session's next prefill needs (``remote_block_ids``, ``remote_engine_id``,
``remote_num_tokens``, ``remote_blocks_expiry_time``...). vLLM 0.32 returns it only in
non-streamed responses; vLLM PR 40186 (not merged) adds it to the final streamed chunk. Without
it every streamed turn is a miss (docs/design.md).

This module applies the same change in-process, in the API-server process that turnscope starts
(``python -m serving.vllm_worker``), before the server is built. It never edits site-packages.
Instead of rewriting vLLM's generators it wraps them: the engine's ``RequestOutput`` stream is
observed for ``kv_transfer_params``, and one extra chunk with empty ``choices`` and the params is
emitted right before ``data: [DONE]`` (the same shape as the usage-only chunk, so OpenAI clients
skip it). Version guard: nothing is patched when the installed vLLM's stream response models
already declare ``kv_transfer_params``.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

DONE_EVENT = "data: [DONE]\n\n"
_PATCHED_ATTR = "__turnscope_stream_handle_patch__"


def vllm_streams_handles() -> bool:
    """True when the installed vLLM already sends ``kv_transfer_params`` in streamed chunks."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    return ("kv_transfer_params" in ChatCompletionStreamResponse.model_fields
            and "kv_transfer_params" in CompletionStreamResponse.model_fields)


class _HandleCapture:
    """Wraps the engine's async output stream and remembers the last ``kv_transfer_params``."""

    def __init__(self, outputs: AsyncIterator[Any]):
        self._outputs = outputs
        self.kv_transfer_params: dict | None = None

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        async for item in self._outputs:
            # Completions yield (prompt_index, RequestOutput); chat yields RequestOutput.
            output = item[1] if isinstance(item, tuple) else item
            params = getattr(output, "kv_transfer_params", None)
            if params:
                self.kv_transfer_params = params
            yield item


def _final_chunk(obj: str, request_id: str, model_name: str, params: dict) -> str:
    chunk = {"id": request_id, "object": obj, "created": int(time.time()), "model": model_name,
             "choices": [], "kv_transfer_params": params}
    return f"data: {json.dumps(chunk)}\n\n"


def _wrap(generator_fn, result_arg_index: int, chunk_object: str, model_arg_index: int):
    """Wrap a vLLM stream generator method (see module docstring)."""

    @functools.wraps(generator_fn)
    async def wrapped(self, *args, **kwargs):
        args = list(args)
        capture = _HandleCapture(args[result_arg_index])
        args[result_arg_index] = capture
        request_id = args[result_arg_index + 1]
        model_name = args[model_arg_index]
        async for event in generator_fn(self, *args, **kwargs):
            if event == DONE_EVENT and capture.kv_transfer_params:
                yield _final_chunk(chunk_object, request_id, model_name, capture.kv_transfer_params)
            yield event

    setattr(wrapped, _PATCHED_ATTR, True)
    return wrapped


def apply() -> bool:
    """Patch vLLM's chat and completion stream generators; return True if a patch was applied.

    Idempotent. Raises RuntimeError when the generator signatures are not the ones this patch
    was written against (vLLM 0.32: ``chat_completion_stream_generator(request,
    result_generator, request_id, model_name, ...)`` and ``completion_stream_generator(request,
    engine_inputs, result_generator, request_id, created_time, model_name, ...)``).
    """
    if vllm_streams_handles():
        return False
    import inspect

    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    targets = [
        (OpenAIServingChat, "chat_completion_stream_generator", "chat.completion.chunk",
         ["request", "result_generator", "request_id", "model_name"]),
        (OpenAIServingCompletion, "completion_stream_generator", "text_completion",
         ["request", "engine_inputs", "result_generator", "request_id", "created_time", "model_name"]),
    ]
    applied = False
    for cls, name, chunk_object, expected in targets:
        original = getattr(cls, name)
        if getattr(original, _PATCHED_ATTR, False):
            continue
        params = list(inspect.signature(original).parameters)[1:]  # drop self
        if params[: len(expected)] != expected:
            raise RuntimeError(
                f"turnscope stream patch: {cls.__name__}.{name} has parameters {params[:len(expected)]}, "
                f"expected {expected}; this vLLM version needs a new patch (see vLLM PR 40186)")
        setattr(cls, name, _wrap(original, expected.index("result_generator"), chunk_object,
                                 expected.index("model_name")))
        applied = True
    return applied
