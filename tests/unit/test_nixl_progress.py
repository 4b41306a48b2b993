"""serving/nixl_progress.py: the agent config's pthrDelay kept off 0 by the patched class, on a
stand-in for nixl's pybind module (the real one is checked through real workers in
tests/integration/test_pd_bidir_vllm.py; the setting it reads: tests/unit/test_plugin_env.py)."""

import types

from serving import nixl_progress


class _Config:
    """Like nixl's nixlAgentConfig: plain attributes, pthrDelay defaulting to 0."""

    def __init__(self):
        self.pthrDelay = 0
        self.lthrDelay = 0


def test_the_agent_config_keeps_the_delay_where_nixl_sets_0():
    bind = types.SimpleNamespace(nixlAgentConfig=_Config)
    assert nixl_progress.patch_config_class(bind, 100)
    c = bind.nixlAgentConfig()
    assert c.pthrDelay == 100  # the constructor's 0 replaced
    c.pthrDelay = 0           # what nixl_agent.__init__ does next
    c.lthrDelay = 0
    assert (c.pthrDelay, c.lthrDelay) == (100, 0)
    c.pthrDelay = 7           # any other value is left as set
    assert c.pthrDelay == 7
    assert not nixl_progress.patch_config_class(bind, 50)  # patched once
    assert bind.nixlAgentConfig().pthrDelay == 100
