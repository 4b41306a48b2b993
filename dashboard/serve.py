"""Start the dashboard's Streamlit server with the pages' heavy libraries already imported.

`streamlit run dashboard/app.py` imports what the pages need (pandas, pyarrow, DuckDB, plotly,
scipy.stats) only when the first browser session runs the script, so the first visit after the
server starts waits for those imports: seconds on a 2-core machine, the largest part of a cold
page (docs/dashboard.md; bench/dashboard_browser.py). This launcher imports them
in the server's process before Streamlit starts listening, then hands over to Streamlit's own
command line with the given options, so the first visit finds them in ``sys.modules``. The
dashboard's own modules are left to the script: their ``st.cache_data`` functions must be
defined under Streamlit's runtime.

    python dashboard/serve.py --server.port 8501 ...   # what `turnscope dashboard` runs

Options are `streamlit run`'s (``--server.port``, ``--server.address``, ...); exits with
Streamlit's exit status.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
APP = HERE / "app.py"
#: Imported before the server starts: the third-party libraries every page's first run imports.
PRELOAD = (
    "pandas",
    "pyarrow",
    "pyarrow.parquet",
    "duckdb",
    "plotly.graph_objects",
    "plotly.io",
    "scipy.stats",
)


def preload() -> None:
    """Import `PRELOAD`. Run as a file, this script's folder (dashboard/) is first on ``sys.path``,
    where a module such as ``tables.py`` would shadow a library's optional import; it is dropped
    first (``streamlit run`` puts it back for the app's script)."""
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path.pop(0)
    for name in PRELOAD:
        importlib.import_module(name)


def warm_store() -> None:
    """Make the in-memory copy of the store's views (``store.db.views_db``, the store of
    ``$TURNSCOPE_STORE``) before the first visit, which would otherwise wait for it (0.2-0.4 s on
    2 cores). A store that cannot be read is left to the pages, which say why."""
    code_root = str(HERE.parent)
    if code_root not in sys.path:  # as dashboard/app.py does, so the script finds the same module
        sys.path.insert(0, code_root)
    import duckdb

    from store import db

    try:
        db.views_db(db.store_from_env())
    except (db.StoreMissing, db.StoreBusy, duckdb.Error, OSError, ValueError):
        pass


def main(options: list[str] | None = None) -> None:
    """`streamlit run dashboard/app.py OPTIONS` after `preload` and `warm_store`; `options` default
    to ``sys.argv[1:]``."""
    preload()
    warm_store()
    from streamlit.web import cli

    sys.argv = ["streamlit", "run", str(APP), *(sys.argv[1:] if options is None else options)]
    cli.main()


if __name__ == "__main__":
    main()
