"""Names are typed once (docs/design.md: what adding a serving mode, a trace format or a ledger
strategy touches): a serving mode's, a ledger strategy's, a trace format's and a reuse outcome's name
is written as a string only in its registry (and a format's in its reader module too); the roles and
the outcomes are listed once (``core.contract``). Read from the source with ``ast``, so the
Streamlit pages and the Locust file need not run; docstrings are text and not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from core import contract, modes
from loadgen.traces import formats
from planner import strategies
from tests.unit.test_layers import PACKAGES

REPO = Path(__file__).resolve().parents[2]
#: The product's code (tests and scripts aside).
PRODUCT = PACKAGES

MODES_PY = "core/modes.py"
CONTRACT_PY = "core/contract.py"
STRATEGIES_PY = "planner/strategies.py"
FORMATS_PY = "loadgen/traces/formats.py"

#: A literal that is one of these names, anywhere else, is a violation.
MODE_NAMES = frozenset((*modes.MODES, modes.ATTACH_MODE))
STRATEGY_NAMES = frozenset(strategies.STRATEGIES)
OUTCOME_NAMES = frozenset(contract.OUTCOMES)
ROLE_NAMES = frozenset(contract.ENDPOINT_ROLES)
#: ``run`` (recorded runs) is also a common word (a run's writer id, a column's label): the code
#: compares with ``formats.RECORDED_RUNS``, but the word itself is not checked.
FORMAT_NAMES = frozenset(formats.FORMATS) - {formats.RECORDED_RUNS}

#: (module, literal): why the literal there is no mode, strategy, format or outcome name.
NOT_A_NAME = {
    ("core/connector.py", "recompute"): "vLLM's kv_load_failure_policy value, not the ledger strategy",
}


def _module_of(ref: str) -> str:
    """The file of a ``"module:function"`` reference."""
    return ref.partition(":")[0].replace(".", "/") + ".py"


def format_modules(name: str) -> set[str]:
    """The registry and the reader modules of format ``name`` (every module its entry names)."""
    f = formats.trace_format(name)
    refs = (f.requests, f.check, f.replay, f.empirical)
    return {FORMATS_PY} | {_module_of(r) for r in refs if r}


def allowed_in(name: str) -> set[str]:
    """The modules where ``name`` may be written as a string: its registries."""
    where: set[str] = set()
    if name in MODE_NAMES:
        where.add(MODES_PY)
    if name in STRATEGY_NAMES:
        where.add(STRATEGIES_PY)
    if name in OUTCOME_NAMES or name in ROLE_NAMES:
        where.add(CONTRACT_PY)
    if name in FORMAT_NAMES:
        where |= format_modules(name)
    return where


CHECKED = MODE_NAMES | STRATEGY_NAMES | OUTCOME_NAMES | FORMAT_NAMES


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _strings(node: ast.AST) -> list[str] | None:
    """The strings of a tuple, list or set literal (or a dict literal's keys) whose items are all
    string constants; None for anything else."""
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items:
        return None
    if not all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
        return None
    return [i.value for i in items]


def violations(source: str, path: str) -> list[str]:
    """What ``source`` (the module at ``path``, relative to the repository) writes by hand: a mode,
    strategy, format or outcome name outside its registry; a collection listing roles or outcomes
    (two or more, nothing else) outside the contract."""
    tree = ast.parse(source, path)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            v = node.value
            if v in CHECKED and path not in allowed_in(v) and (path, v) not in NOT_A_NAME:
                out.append(f"{path}:{node.lineno}: {v!r} (written only in {', '.join(sorted(allowed_in(v)))})")
        names = _strings(node)
        if names and len(names) >= 2 and path != CONTRACT_PY:
            for what, known in (("roles", ROLE_NAMES), ("outcomes", OUTCOME_NAMES)):
                if set(names) <= known:
                    out.append(f"{path}:{node.lineno}: {names} lists {what} by hand "
                               f"(take them from core.contract)")
    return out


def product_files() -> list[Path]:
    return sorted(p for part in PRODUCT for p in (REPO / part).rglob("*.py"))


def test_names_are_written_only_in_their_registry() -> None:
    found = [v for p in product_files() for v in violations(p.read_text(), p.relative_to(REPO).as_posix())]
    assert not found, "names spelled by hand:\n" + "\n".join(found)


def test_every_exception_is_still_needed() -> None:
    for path, name in NOT_A_NAME:
        assert f'"{name}"' in (REPO / path).read_text(), f"{path} no longer writes {name!r}: drop its exception"


# -- the checker catches what it should (planted violations) ----------------------------------------

@pytest.mark.parametrize("source, path", [
    ('MODE = "pd-bidir"\n', "dashboard/figures/plan.py"),
    ('if mode == "aggregated":\n    pass\n', "planner/fit.py"),
    ('S = {"recompute": 1}\n', "planner/recommend.py"),
    ('x: Literal["pd+host"] = "pd+host"\n', "planner/ledger.py"),
    ('FMT = "mooncake"\n', "loadgen/workload.py"),
    ('FMT = "mooncake"\n', "loadgen/traces/azure.py"),
    ('OK = reuse == "miss_expired"\n', "dashboard/figures/traffic.py"),
    ('ROLES = ("prefill", "decode", "aggregated", "proxy")\n', "loadgen/scraper.py"),
    ('for role in ["prefill", "decode"]:\n    pass\n', "serving/stack.py"),
    ('C = {"hit": "#00a6a6", "miss_first_turn": "#d9d9d9"}\n', "dashboard/palette.py"),
    ('def f(x="pd-bidir-nocache"):\n    return x\n', "planner/summary.py"),
])
def test_a_planted_violation_is_caught(source: str, path: str) -> None:
    assert violations(source, path), f"{source!r} in {path} was not flagged"


@pytest.mark.parametrize("source, path", [
    ('PD_BIDIR = "pd-bidir"\n', MODES_PY),
    ('RECOMPUTE = "recompute"\n', STRATEGIES_PY),
    ('FORMAT = "mooncake"\n', "loadgen/traces/mooncake.py"),
    ('register(TraceFormat("taubench"))\n', FORMATS_PY),
    ('HIT = "hit"\nOUTCOMES = ("hit", "miss_expired")\n', CONTRACT_PY),
    ('def f():\n    """Compare pd-bidir against "pd"."""\n', "dashboard/figures/plan.py"),
    ('TIME_COLORS = {"proxy": "#fff", "prefill": "#000", "transfer": "#111"}\n', "dashboard/palette.py"),
    ('policy = "recompute"\n', "core/connector.py"),
    ('x = f"{mode}: pd-bidir against pd"\n', "planner/recommend.py"),
])
def test_a_registry_docstring_or_other_name_is_not_flagged(source: str, path: str) -> None:
    assert not violations(source, path)


# -- one definition each -------------------------------------------------------------------------------

def test_roles_and_outcomes_are_one_definition() -> None:
    assert set(contract.WORKER_ROLES) | {contract.Role.PROXY} == set(contract.ENDPOINT_ROLES) == set(contract.Role)
    assert all(modes.serving_mode(m).roles for m in modes.MODES)
    assert {r for m in modes.SERVING_MODES for r in m.roles} == set(contract.WORKER_ROLES)
    assert len(set(contract.OUTCOMES)) == len(contract.OUTCOMES)


def test_the_dashboard_orders_every_outcome() -> None:
    from dashboard import palette
    from dashboard.figures.common import OUTCOME_ORDER, OUTCOME_SYMBOLS

    shown = set(OUTCOME_ORDER) - {"not recorded"}
    assert shown == set(contract.OUTCOMES) == set(OUTCOME_SYMBOLS) - {"not recorded"}
    assert set(palette.OUTCOME_COLORS) - {"not recorded"} == set(contract.OUTCOMES)


def test_strategies_are_costed_as_known_modes() -> None:
    for s in strategies.LEDGER_STRATEGIES:
        assert s.mode in modes.MODES, s
    assert strategies.RECOMPUTE in strategies.STRATEGIES
    assert strategies.STRATEGIES[strategies.RECOMPUTE] == modes.RECOMPUTE_MODE


# -- docs/design.md's lists of what adding a name touches name what this test checks -----------------

@pytest.mark.parametrize("heading, registry", [
    ("Adding a serving mode", MODES_PY),
    ("Adding a trace format", FORMATS_PY),
    ("Adding a ledger strategy", STRATEGIES_PY),
])
def test_design_lists_each_registry(heading: str, registry: str) -> None:
    text = (REPO / "docs" / "design.md").read_text()
    m = re.search(rf"\*\*{heading}\*\*.*?(?=\n\n(?!\d\.|   )|\Z)", text, re.DOTALL)
    assert m, f"docs/design.md has no **{heading}** list"
    assert registry in m.group(0) and "tests/unit/test_names.py" in m.group(0), m.group(0)
