"""The in-process port of vLLM PR 40186: streamed responses end with D's kv_transfer_params."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from serving import stream_handle_patch as patch


class FakeServing:
    async def chat_completion_stream_generator(self, request, result_generator, request_id, model_name):
        async for out in result_generator:
            yield f"data: {json.dumps({'choices': [{'delta': {'content': out.text}}]})}\n\n"
        yield patch.DONE_EVENT


async def outputs(params_on_last):
    yield SimpleNamespace(text="a", kv_transfer_params=None)
    yield SimpleNamespace(text="b", kv_transfer_params=params_on_last)


def run(params):
    wrapped = patch._wrap(FakeServing.chat_completion_stream_generator, 1, "chat.completion.chunk", 3)

    async def collect():
        return [e async for e in wrapped(FakeServing(), "req", outputs(params), "chatcmpl-1", "m")]
    return asyncio.run(collect())


def test_final_chunk_carries_the_handle_before_done():
    events = run({"remote_block_ids": [[4, 5]], "remote_num_tokens": 200})
    assert events[-1] == patch.DONE_EVENT
    final = json.loads(events[-2][len("data: "):])
    assert final["choices"] == [] and final["id"] == "chatcmpl-1" and final["model"] == "m"
    assert final["kv_transfer_params"] == {"remote_block_ids": [[4, 5]], "remote_num_tokens": 200}
    assert len(events) == 4  # two content chunks, the handle chunk, [DONE]


def test_no_extra_chunk_without_a_handle():
    assert len(run(None)) == 3


def test_apply_patches_installed_vllm_once_and_checks_signatures(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    if patch.vllm_streams_handles():
        pytest.skip("this vLLM streams kv_transfer_params itself (PR 40186 merged)")
    original = OpenAIServingChat.chat_completion_stream_generator
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    original_c = OpenAIServingCompletion.completion_stream_generator
    try:
        assert patch.apply() is True
        assert patch.apply() is False  # idempotent
    finally:
        OpenAIServingChat.chat_completion_stream_generator = original
        OpenAIServingCompletion.completion_stream_generator = original_c

    async def other(self, request, something_else, request_id, model_name):
        yield patch.DONE_EVENT
    monkeypatch.setattr(OpenAIServingChat, "chat_completion_stream_generator", other)
    with pytest.raises(RuntimeError, match="needs a new patch"):
        patch.apply()
