"""Noticing that the client of a request went away while the proxy waits on a worker.

Starlette cancels a :class:`~starlette.responses.StreamingResponse` when its client disconnects,
but not a route that is still awaiting something before it returns a response: the proxy's
prefill leg, the opening of D's stream, or the whole of a non-streamed decode leg. Without a
watch those legs run to the end for nobody (the engine generating to ``max_tokens``, as a
non-streamed handler that was never cancelled did in ROCm/ATOM issue 1562).
:func:`run_until_client_gone` runs such work against the ASGI ``http.disconnect`` message and
cancels it when the message comes first; cancelling an ``httpx`` request closes its connection,
which makes vLLM's server abort the request (its ``with_cancellation`` handlers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def client_gone(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the ASGI ``receive`` channel says the client disconnected. Call it only after
    the request body has been read (every message then is ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_client_gone(receive: Callable[[], Awaitable[dict[str, Any]]],
                                work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` until it finishes or the client goes away, whichever comes first.

    Returns:
        ``(False, result)`` when ``work`` finished (its exception, if any, is raised), or
        ``(True, None)`` when the client went first: ``work`` was cancelled and awaited, so every
        connection it had open to a worker is closed when this returns.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(client_gone(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return False, task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return True, None
