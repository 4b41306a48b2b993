"""The dashboard's pages, one entry each, in menu order.

Adding a page: its script ``dashboard/app_pages/<slug>.py`` (it draws ``st.title(<title>)`` and
reads ``dashboard.context.current()``) and one :class:`Page` in :data:`PAGES`. ``dashboard/app.py``
builds Streamlit's navigation from this list; the benches (``bench/dashboard_browser.py``,
``bench/dashboard_scale.py``) and the tests (``tests/integration/test_dashboard_*.py``,
``tests/e2e/``) take their pages, scripts, titles and URL paths from it, and
``tests/unit/test_dashboard_registry.py`` checks it against the scripts.

Imports no Streamlit, so a bench or a test reads it without starting the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: The dashboard's main script (``streamlit run`` and ``AppTest.from_file`` take it).
APP = Path(__file__).resolve().with_name("app.py")

#: What a page draws, i.e. what the store must hold for it to show more than an empty state:
#: ``runs`` recorded evaluation runs (``turnscope eval``/``demo``), ``sweeps`` the runs of a prefix
#: sweep, ``traffic`` traffic reports (``turnscope traffic``), ``plans`` forecasts (``turnscope
#: plan``), ``store`` any of its tables (the SQL console).
Draws = Literal["runs", "sweeps", "traffic", "plans", "store"]


@dataclass(frozen=True)
class Page:
    """One page: ``slug`` names its script (``app_pages/<slug>.py``) and its URL path (Streamlit's,
    from the file name; ``""`` for the default page); ``title`` is its menu entry and the heading
    its script draws; ``icon`` a Material icon (``:material/<name>:``)."""

    slug: str
    title: str
    icon: str
    draws: Draws
    default: bool = False

    @property
    def script(self) -> str:
        """The script, relative to :data:`APP` (as ``st.Page`` and ``AppTest.switch_page`` take it)."""
        return f"app_pages/{self.slug}.py"

    @property
    def url_path(self) -> str:
        """The page's path under the dashboard's URL."""
        return "" if self.default else self.slug

    @property
    def needs_runs(self) -> bool:
        """Whether the page is hidden in a store without recorded runs (one of forecasts or traffic
        reports only)."""
        return self.draws in ("runs", "sweeps")


PAGES: tuple[Page, ...] = (
    Page("overview", "Overview", ":material/dashboard:", "runs", default=True),
    Page("turns", "Turns", ":material/timeline:", "runs"),
    Page("sessions", "Sessions", ":material/account_tree:", "runs"),
    Page("memory", "Memory", ":material/memory:", "runs"),
    Page("compare", "Compare", ":material/compare_arrows:", "runs"),
    Page("sweep", "Sweep", ":material/stacked_line_chart:", "sweeps"),
    Page("traffic", "Traffic", ":material/airline_stops:", "traffic"),
    Page("plan", "Plan", ":material/online_prediction:", "plans"),
    Page("sql", "SQL", ":material/terminal:", "store"),
)


def page(slug: str) -> Page:
    """The page of ``slug``. Raises KeyError naming the slugs there are."""
    for p in PAGES:
        if p.slug == slug:
            return p
    raise KeyError(f"no dashboard page {slug!r}; pages: {', '.join(p.slug for p in PAGES)}")


def by_title(title: str) -> Page:
    """The page whose menu entry is `title`. Raises KeyError naming the titles there are."""
    for p in PAGES:
        if p.title == title:
            return p
    raise KeyError(f"no dashboard page titled {title!r}; pages: {', '.join(p.title for p in PAGES)}")


def drawing(*draws: Draws) -> tuple[Page, ...]:
    """The pages that draw any of ``draws``, in menu order (``drawing("runs", "store")``: the pages
    an evaluation's store fills)."""
    return tuple(p for p in PAGES if p.draws in draws)
