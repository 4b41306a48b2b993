"""serving/plugin_env.py through both plugins that read it: a non-negative integer, None when unset,
empty or 0, and an error naming the variable and its unit otherwise."""

import pytest

from serving import engine_idle_wait, nixl_progress


@pytest.mark.parametrize("read, env, unit", [(nixl_progress.delay_us, nixl_progress.ENV, "microseconds"),
                                             (engine_idle_wait.wait_ms, engine_idle_wait.ENV, "milliseconds")])
def test_each_plugin_reads_its_setting(read, env, unit):
    assert read({}) is None
    assert read({env: ""}) is None
    assert read({env: "0"}) is None  # the plugin changes nothing
    assert read({env: "250"}) == 250
    for bad in ("-5", "1.5", "fast"):
        with pytest.raises(ValueError, match=f"{env}=.*expected {unit}"):
            read({env: bad})
