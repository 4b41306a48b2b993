"""The shared leaf modules (core.contract, .tokenize_client, .redaction, .store) import none of the parts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.contract import PUBLIC_FACT_KEYS, PublicFacts, common_prefix_length
from tests.unit.test_layers import PACKAGES


@pytest.mark.parametrize("module", ["core.contract", "core.tokenize_client", "core.redaction",
                                    "store.writer"])
def test_a_shared_module_imports_no_part(module: str) -> None:
    """The ground imports nothing above it, the store's writer nothing above the store."""
    above = sorted(set(PACKAGES) - {"core", module.split(".")[0]})
    code = (f"import sys, {module}; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({above!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_fact_keys_are_the_typed_dict_in_wire_order() -> None:
    # the order the proxy sent them in before the contract existed (serving/proxy.py public_facts)
    assert PUBLIC_FACT_KEYS == ("reuse", "prefill_cached_tokens", "remote_tokens", "reused_tokens",
                                "recomputed_tokens", "handle_age_s", "divergence_position", "prefill_leg_s",
                                "prefill_attempts", "handle_tokens")
    assert set(PublicFacts.__annotations__) == set(PUBLIC_FACT_KEYS)


@pytest.mark.parametrize(("a", "b", "n"), [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                           ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0)])
def test_common_prefix_length_by_hand(a, b, n) -> None:
    assert common_prefix_length(a, b) == n
