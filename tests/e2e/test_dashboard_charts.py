"""Every chart shows its data, checked in a real browser.

For every page of the dashboard, on two stores (the dashboard test store, tests/dashboard_store.py,
with a stored recommendation whose ledger has interval bars, and the planner's recorded runs with a
traffic report and two plans), and on the "Export these runs
as HTML" file, this reads each drawn Plotly figure back from the DOM (``el._fullLayout``'s axes as
plotly.js rendered them, matched and overlaying axes included, and ``el._fullData``'s points) and
checks:

- every finite point of every visible trace lies inside the rendered range of its own axes (log axes
  compared in log10, dates in ms, categories by index: plotly.js's own ``d2l``/``r2l`` conversions);
- a figure with points draws marks (a line, a marker, a bar), so no figure with rows is blank.

The truth is independent of the dashboard's code: where plotly.js put the axes against the data it
was given. A blank chart (an axis range fixed at [0, 4] while the data sit at 36-923 ms) fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard import pages
from tests import dashboard_store
from tests.e2e.test_dashboard_browser import (  # noqa: F401  (browser: a fixture used below)
    CHROMIUM,
    REPO,
    WIDTH,
    _streamlit,
    _wait_idle,
    browser,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: apt-get install chromium"),
]

#: (URL path, heading) of every page of the dashboard (dashboard/pages.py).
PAGES = [(p.url_path, p.title) for p in pages.PAGES]

#: Reads every drawn figure: per trace, the points outside its axes' rendered ranges; per figure,
#: the number of points and of drawn marks. Runs in the page.
READ_FIGURES = r"""
() => {
  const out = [];
  const arr = (v) => (v == null ? [] : (typeof v === 'string' ? [v] : Array.from(v)));
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    const fl = el._fullLayout, fd = el._fullData;
    if (!fl || !fd) { out.push({title: '(not drawn)', points: -1, marks: 0, outside: []}); continue; }
    const title = (fl.title && fl.title.text) || '';
    let points = 0;
    const outside = [];
    for (const tr of fd) {
      if (tr.visible !== true) continue;
      const axes = [];
      let tracePoints = 0;
      if (tr.xaxis) axes.push(['x', 'xaxis' + tr.xaxis.slice(1)]);
      if (tr.yaxis) axes.push(['y', 'yaxis' + tr.yaxis.slice(1)]);
      for (const [key, name] of axes) {
        const ax = fl[name];
        if (!ax || !ax.range) continue;
        const vals = arr(tr[key]);
        const lo = Math.min(ax.r2l(ax.range[0]), ax.r2l(ax.range[1]));
        const hi = Math.max(ax.r2l(ax.range[0]), ax.r2l(ax.range[1]));
        const slack = (hi - lo) * 1e-6;
        let n = 0;
        for (const v of vals) {
          if (v === null || v === undefined || v === '') continue;
          const l = ax.d2l(v);
          if (!Number.isFinite(l)) continue;
          n += 1;
          if (l < lo - slack || l > hi + slack) {
            outside.push({trace: tr.name || String(tr.index), axis: name, type: ax.type,
                          value: String(v), range: [lo, hi]});
            break;
          }
        }
        tracePoints = Math.max(tracePoints, n);
      }
      points += tracePoints;
    }
    const marks = el.querySelectorAll(
      '.scatterlayer .trace path.js-line, .scatterlayer .point, .barlayer .point path, '
      + '.boxlayer path.box, .heatmaplayer image, .scatterlayer path.js-fill').length;
    out.push({title, points, marks, outside: outside.slice(0, 5)});
  }
  return out;
}
"""


def _settle(page) -> None:
    """Wait until Streamlit is idle and the number of drawn figures stops changing."""
    _wait_idle(page)
    last, same = -1, 0
    for _ in range(80):  # three looks in a row, 0.5 s apart, with the same count
        page.wait_for_timeout(500)
        n = page.evaluate("document.querySelectorAll('.js-plotly-plot .main-svg').length")
        same = same + 1 if n == last else 0
        if same >= 2:
            break
        last = n
    _wait_idle(page)


def check_figures(page, where: str) -> int:
    """Assert every drawn figure on `page` shows its data; returns the number of figures checked."""
    figures = page.evaluate(READ_FIGURES)
    problems = []
    for i, f in enumerate(figures):
        name = f"{where} figure {i} {f['title']!r}"
        if f["points"] < 0:
            problems.append(f"{name}: never drawn")
            continue
        if f["outside"]:
            problems.append(f"{name}: points outside the drawn axes: {f['outside']}")
        if f["points"] > 0 and f["marks"] == 0:
            problems.append(f"{name}: {f['points']} points but nothing drawn")
    assert not problems, "\n".join(problems)
    return len(figures)


def _check_pages(browser, url: str, store: str, pages=PAGES) -> dict[str, int]:  # noqa: F811
    counts: dict[str, int] = {}
    for path, title in pages:
        page = browser.new_page(viewport={"width": WIDTH, "height": 4000})
        errors: list[str] = []
        page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
        page.goto(f"{url}/{path}", wait_until="domcontentloaded")
        page.get_by_role("heading", name=title, exact=True).wait_for(timeout=60_000)
        _settle(page)  # the default view: charts drawn without a click (dashboard/charts.py)
        if title == "Sessions" and page.locator('[data-testid="stSelectbox"]').count():
            page.locator('[data-testid="stSelectbox"]').first.click(timeout=60_000)
            page.get_by_role("option").first.click(timeout=60_000)
            _settle(page)
        assert page.locator('[data-testid="stException"]').count() == 0, f"{store} {title}: an exception"
        counts[title] = check_figures(page, f"{store} {title}")
        assert not errors, errors
        page.close()
    return counts


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    """Like the demo's store, more than one (workload, history) group: the dashboard test store's runs
    (coding-agent, token_ids) plus the planner's (planner-fixture), so the Overview draws one panel per
    group on shared axes; and a `turnscope recommend --store` of one shipped trace with a profile
    that has held-out errors, so the Plan page draws the ledger's chart with interval bars."""
    import yaml
    from typer.testing import CliRunner

    from tests import planner_store
    from turnscope.commands import app

    tmp = tmp_path_factory.mktemp("charts-demo")
    root = dashboard_store.build(tmp / "store")
    planner_store.build(root)
    profile = yaml.safe_load((REPO / "data/profiles/vendor-h200.yaml").read_text())
    profile["held_out"] = {"split": "hand-made", "runs": 4, "turns": 40,
                           "ttft_ratio": {"pd-nocache": [0.9, 1.2], "pd": [0.8, 1.25], "pd-bidir": [0.85, 1.3]},
                           "hit_rate_error": {"pd-bidir": [-0.1, 0.05]}}
    (tmp / "held.yaml").write_text(yaml.safe_dump(profile))
    r = CliRunner().invoke(app, ["recommend", str(REPO / "data/traces/kv-cache-tester/trace_0036.json"), "--profile",
                                 str(tmp / "held.yaml"), "--store", str(root), "--label", "ledger"],
                           env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    with _streamlit(root, tmp) as url:
        yield url


@pytest.fixture(scope="module")
def planned_url(planned_store, tmp_path_factory):
    """The dashboard over the shared planned store (``planned_store``, tests/e2e/conftest.py)."""
    with _streamlit(planned_store, tmp_path_factory.mktemp("charts-planned")) as url:
        yield url


def test_every_chart_shows_its_data_demo_store(demo_url, browser, tmp_path):  # noqa: F811
    counts = _check_pages(browser, demo_url, "demo store")
    # the pages that draw from runs drew figures (a page of empty states would pass vacuously)
    assert counts["Overview"] >= 3 and counts["Turns"] >= 3 and counts["Memory"] >= 2, counts
    assert counts["Plan"] == 1, counts   # the ledger's chart of the stored recommendation
    # The HTML export, opened as a file.
    page = browser.new_page(viewport={"width": WIDTH, "height": 4000}, accept_downloads=True)
    page.goto(demo_url, wait_until="domcontentloaded")
    page.get_by_role("heading", name="Overview", exact=True).wait_for(timeout=60_000)
    _settle(page)
    with page.expect_download(timeout=60_000) as dl:
        page.get_by_role("button", name="Export these runs as HTML").click(timeout=60_000)
    saved = Path(tmp_path) / "runs.html"
    dl.value.save_as(saved)
    page.goto(saved.as_uri(), wait_until="load")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 8", timeout=60_000)
    page.wait_for_timeout(1000)
    assert check_figures(page, "HTML export") >= 8
    page.close()


def test_every_chart_shows_its_data_planned_store(planned_url, browser):  # noqa: F811
    counts = _check_pages(browser, planned_url, "planned store")
    assert counts["Overview"] >= 2 and counts["Traffic"] >= 5 and counts["Plan"] >= 2, counts


@pytest.mark.parametrize(("fixture", "path", "title", "least"), [
    ("sweep_store", "sweep", "Sweep", 2),  # a prefix sweep: TTFT and speed-up against prefix length
    ("capacity_store", "memory", "Memory", 3),  # a capacity ramp: the Memory page's capacity section
    ("eviction_store", "memory", "Memory", 4),  # P's eviction ladder: the capacity curve and the window
])
def test_every_chart_shows_its_data_sweep_and_capacity(browser, tmp_path, fixture, path, title, least):  # noqa: F811
    """The pages whose figures need a sweep or a capacity ramp, on the stores that hold one."""
    import importlib

    build = importlib.import_module(f"tests.{fixture}").build
    with _streamlit(build(tmp_path / "store"), tmp_path) as url:
        counts = _check_pages(browser, url, fixture, [(path, title)])
    assert counts[title] >= least, counts


#: The load curve's traces, SLO and shapes as plotly.js drew them: per trace its name, mode, x, y
#: and marker symbol; per shape its name, x0, x1, y0, y1 and whether it is filled. Runs in the page.
READ_LOAD_CURVE = r"""
() => {
  const el = [...document.querySelectorAll('.js-plotly-plot')]
    .find(e => e._fullLayout && ((e._fullLayout.title || {}).text || '').includes('p90 TTFT against load'));
  if (!el) return null;
  const arr = (v) => (v == null ? [] : Array.from(v));
  return {
    traces: el._fullData.filter(t => t.visible === true).map(t => ({
      name: t.name, mode: t.mode, x: arr(t.x).map(Number), y: arr(t.y).map(Number),
      symbol: (t.marker || {}).symbol || null})),
    shapes: (el._fullLayout.shapes || []).map(s => ({name: s.name, type: s.type, x0: s.x0, x1: s.x1,
                                                     y0: s.y0, y1: s.y1, filled: !!s.fillcolor && s.type === 'rect'})),
    xrange: el._fullLayout.xaxis.range, xtype: el._fullLayout.xaxis.type,
    drawnShapes: el.querySelectorAll('.shapelayer path, .layer-below .shapelayer path').length,
  };
}
"""


@pytest.fixture(scope="module")
def fleet_url(tmp_path_factory):
    """A store holding only the hand-made fleet plan (tests/planner_store.py: FLEET_ROWS, CURVE)."""
    from tests import planner_store

    tmp = tmp_path_factory.mktemp("charts-fleet")
    with _streamlit(planner_store.build_fleet_plan(tmp / "store"), tmp) as url:
        yield url


def test_load_curve_draws_its_data(fleet_url, browser):  # noqa: F811
    """The Plan page's load curve of the hand-made fleet plan: one line per strategy through its
    forecast p90 TTFTs (ms) at the loads where it is not overloaded, its overloaded loads as open
    markers on a band above every TTFT and the SLO, the SLO at 1,000 ms, and the region from 200 new
    sessions per hour (where the recommended pd-bidir 2P 2D is first overloaded) shaded. Truths:
    the fixture's hand-typed figures, restated here."""
    from tests.e2e.test_dashboard_browser import _shot

    page = browser.new_page(viewport={"width": WIDTH, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{fleet_url}/plan", wait_until="domcontentloaded")
    page.get_by_role("heading", name="Plan", exact=True).wait_for(timeout=60_000)
    _settle(page)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 1", timeout=60_000)
    _settle(page)
    fig = page.evaluate(READ_LOAD_CURVE)
    assert fig is not None, "no load curve drawn"
    lines = {t["name"]: t for t in fig["traces"] if t["mode"] == "lines+markers"}
    # the finite points, by hand (ms): loads 25, 50, 100, 200, 400 new sessions per hour
    truth = {"recompute (2P 2D)": [(25, 1200)],
             "pd (3P 3D)": [(25, 550), (50, 620), (100, 930)],
             "pd+host (3P 2D)": [(25, 500), (50, 580), (100, 880), (200, 2900)],
             "pd-bidir (2P 2D)": [(25, 410), (50, 480), (100, 740)],
             "pd-bidir+host (2P 2D)": [(25, 450), (50, 560), (100, 1120), (200, 3400)]}
    assert list(lines) == list(truth)  # the ledger's order
    for name, points in truth.items():
        assert lines[name]["x"] == [x for x, _ in points], name
        assert lines[name]["y"] == pytest.approx([y for _, y in points]), name
    assert [t["symbol"] for t in lines.values()] == ["square", "circle", "circle-open", "diamond", "diamond-open"]
    over = {t["name"]: t for t in fig["traces"] if t["name"].endswith(" overloaded")}
    assert {n: t["x"] for n, t in over.items()} == {
        "recompute overloaded": [50, 100, 200, 400], "pd overloaded": [200, 400], "pd+host overloaded": [400],
        "pd-bidir overloaded": [200, 400], "pd-bidir+host overloaded": [400]}
    lanes = {n: set(t["y"]) for n, t in over.items()}
    assert all(len(y) == 1 for y in lanes.values())  # one lane per strategy, a lane each
    band_y = [min(y) for y in lanes.values()]
    assert len(set(band_y)) == 5 and min(band_y) > 3400  # above every TTFT (3,400 ms) and the SLO
    assert all(t["symbol"].endswith("-open") for t in over.values())
    (slo,) = [t for t in fig["traces"] if t["name"].startswith("SLO")]
    assert slo["y"] == [1000, 1000] and slo["mode"] == "lines"
    # each fleet's knee (tests/planner_store.py's CURVE_KNEES): a star on its line at that load
    knee = next(t for t in fig["traces"] if t["name"].startswith("knee"))
    assert sorted(zip(knee["x"], knee["y"], strict=True)) == [(50, 560), (100, 740), (100, 880), (100, 930)]
    assert knee["symbol"] == "star"
    assert len(fig["traces"]) == 5 + 5 + 1 + 1
    shapes = {s["name"]: s for s in fig["shapes"]}
    shaded = shapes["recommended fleet overloaded"]
    assert shaded["filled"] and shaded["x0"] == pytest.approx(200) and shaded["x1"] >= 400
    band = shapes["overloaded band"]
    assert band["filled"] and 3400 < band["y0"] < min(band_y) and max(band_y) < band["y1"]
    assert shapes["sized at"]["x0"] == pytest.approx(100)
    assert fig["drawnShapes"] >= 3
    assert check_figures(page, "fleet store Plan") == 1
    page.mouse.move(WIDTH - 5, 5)  # no tooltip of the sidebar's button in the picture
    _shot(page, "plan-fleet")
    assert not errors, errors
    page.close()
