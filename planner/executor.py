"""Where the planner's independent forecasts run (fleet sizing per strategy, the settings of a
recommendation, the points of a load curve): this process, the machine's cores, or a Ray cluster.

Every task is ``fn(shared, item)``: ``shared`` (the traffic and profile, large) is sent to each
worker once, ``item`` (a setting, small) per task. ``fn`` must be a module-level function (it is
pickled by name). Results come back in the order of ``items``.

* :class:`LocalExecutor`: ``workers`` processes of :class:`concurrent.futures.ProcessPoolExecutor`
  (1: this process, no pool); ``shared`` reaches each process once through the pool's initializer;
* :class:`RayExecutor`: tasks on a Ray cluster (``address``: an existing cluster's, or None for a
  local one started here); ``shared`` is put in Ray's object store once. Ray is an optional extra
  (``pip install 'turnscope[ray]'``), the engine vLLM itself uses for multi-node serving.

Both show a progress bar on stderr (tqdm) once a map has run for :data:`PROGRESS_AFTER_S` seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Protocol

from tqdm import tqdm

#: A map's progress bar appears after this many seconds (short maps print nothing).
PROGRESS_AFTER_S = 2.0

_SHARED: Any = None


class Executor(Protocol):
    """Runs ``fn(shared, item)`` for every item; results in the order of ``items``."""

    def map(self, fn: Callable[[Any, Any], Any], shared: Any, items: Sequence[Any], what: str) -> list[Any]: ...


def _bar(total: int, what: str) -> tqdm:
    return tqdm(total=total, desc=what, unit="forecast", delay=PROGRESS_AFTER_S, leave=False, dynamic_ncols=True)


def _init(shared: Any) -> None:
    global _SHARED
    _SHARED = shared


def _call(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_SHARED, item)


class LocalExecutor:
    """``workers`` processes on this machine (None: its cores, ``os.cpu_count()``; 1: inline).

    Raises ValueError for workers < 1."""

    def __init__(self, workers: int | None = None):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers or os.cpu_count() or 1

    def map(self, fn: Callable[[Any, Any], Any], shared: Any, items: Sequence[Any], what: str) -> list[Any]:
        items = list(items)
        with _bar(len(items), what) as bar:
            if self.workers == 1 or len(items) <= 1:
                out = []
                for item in items:
                    out.append(fn(shared, item))
                    bar.update()
                return out
            with ProcessPoolExecutor(min(self.workers, len(items)), initializer=_init, initargs=(shared,)) as pool:
                futures = [pool.submit(_call, fn, item) for item in items]
                for f in futures:
                    f.add_done_callback(lambda _: bar.update())
                return [f.result() for f in futures]


class RayExecutor:
    """Tasks on a Ray cluster: ``address`` of a running one (e.g. ``ray://head:10001`` or ``auto``),
    or None to start a local one in this process (its cores).

    Raises RuntimeError naming the extra when Ray is not installed."""

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError as e:
            raise RuntimeError("the Ray executor needs Ray: pip install 'turnscope[ray]'") from e
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)

    def map(self, fn: Callable[[Any, Any], Any], shared: Any, items: Sequence[Any], what: str) -> list[Any]:
        ray = self.ray
        task = ray.remote(fn)
        ref = ray.put(shared)
        refs = [task.remote(ref, item) for item in items]
        pending = list(refs)
        with _bar(len(refs), what) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.update(len(done))
        return ray.get(refs)


def executor_for(name: str, workers: int | None = None, address: str | None = None) -> Executor:
    """The executor ``name`` (``local`` or ``ray``). Raises ValueError for another name."""
    if name == "local":
        return LocalExecutor(workers)
    if name == "ray":
        return RayExecutor(address)
    raise ValueError(f"executor {name!r}: expected local or ray")
