"""Fixtures and browser helpers for the dashboard tests.

Every test here drives the real thing: a ``python -m gradwatch.server serve`` process on
a SQLite file (the dashboard is the same process, same port), runs fed through
``POST /api/v1/ingest``, and Debian's headless Chromium through Selenium.
Waits are explicit conditions (``wait_until``), never sleeps.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest

from tests.conftest import wait_until

GRAPH_JS = """
const el = document.getElementById(arguments[0]);
const gd = el && (el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot'));
if (!gd || !gd.data || !gd._fullLayout) { return null; }
const arr = (a) => (a === undefined || a === null) ? [] : Array.from(a, (v) => Array.isArray(v) ? Array.from(v) : v);
return {
  data: gd.data.map((t) => ({name: t.name, type: t.type || 'scatter', x: arr(t.x), y: arr(t.y), z: arr(t.z),
                             customdata: arr(t.customdata)})),
  xrange: gd._fullLayout.xaxis ? Array.from(gd._fullLayout.xaxis.range) : null,
  ytype: gd._fullLayout.yaxis ? gd._fullLayout.yaxis.type : null,
  shapes: (gd.layout.shapes || []).map((s) => ({x0: s.x0, label: s.label ? s.label.text : null})),
};
"""


SERVER_START_TIMEOUT = 120.0  # a loaded 2-core machine can take tens of seconds to import and start a server
# How long a condition may take to show in the browser. Generous: on a loaded 2-core machine parsing
# plotly.js alone can take seconds. These are deadlines for failing, not measurements.
WAIT = 60.0


def _start_server(data_dir):
    from tests.conftest import LiveServer, free_port

    srv = LiveServer(db_url=f"sqlite:///{data_dir / 'gradwatch.db'}", data_dir=data_dir, port=free_port())
    srv.migrate()
    srv.start(timeout=SERVER_START_TIMEOUT)
    return srv


@pytest.fixture
def dash_server(tmp_path):
    """A fresh real server (API + dashboard on one port) on its own SQLite file."""
    data_dir = tmp_path / "dashboard-server"
    data_dir.mkdir()
    srv = _start_server(data_dir)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One real server for a whole module, for tests that only look at their own runs.

    Starting a server costs seconds on 2 cores; tests that count every run or
    alert on the server use ``dash_server`` instead.
    """
    srv = _start_server(tmp_path_factory.mktemp("dashboard-server"))
    try:
        yield srv
    finally:
        srv.stop()


def graph(drv, graph_id: str) -> Optional[dict]:
    """What a drawn chart holds: its traces (name, x, y, z), x range, y axis type, shapes."""
    return drv.execute_script(GRAPH_JS, graph_id)


def trace(fig: Optional[dict], name: str) -> Optional[dict]:
    if not fig:
        return None
    return next((t for t in fig["data"] if t["name"] == name), None)


def wait_trace(drv, graph_id: str, name: str, predicate, timeout: float = WAIT, what: str = "") -> dict:
    """Wait until trace ``name`` of chart ``graph_id`` satisfies ``predicate``; return the trace."""
    def check():
        t = trace(graph(drv, graph_id), name)
        return t if t is not None and predicate(t) else None
    return wait_until(check, timeout=timeout, interval=0.1, what=what or f"{graph_id} / {name}")


def severe_console_entries(drv) -> list[dict]:
    return [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]


def mark_page(drv) -> None:
    """Tag the loaded document; :func:`same_page` proves no reload happened since."""
    drv.execute_script("window.__gwNoReload = 'same-document';")


def same_page(drv) -> bool:
    return drv.execute_script("return window.__gwNoReload === 'same-document';")


def choose_option(drv, dropdown_id: str, label: str, timeout: float = WAIT) -> None:
    """Open a Dash 4 dropdown and click the option with this label."""
    from selenium.webdriver.common.by import By

    wait_until(lambda: drv.find_elements(By.ID, dropdown_id), timeout=timeout, what=f"dropdown {dropdown_id}")
    drv.find_element(By.ID, dropdown_id).click()

    def option():
        from selenium.common.exceptions import StaleElementReferenceException

        try:
            for el in drv.find_elements(By.CSS_SELECTOR, "[role=listbox] .dash-dropdown-option"):
                if el.text.strip() == label:
                    return el
        except StaleElementReferenceException:   # the list re-rendered between find and read: look again
            pass
        return None
    wait_until(option, timeout=timeout, what=f"option {label!r} of {dropdown_id}").click()


def text_of(drv, element_id: str) -> str:
    """The element's visible text, read in one script call: Dash may replace the element between a
    find_element and a .text (a StaleElementReferenceException the fresh-clone CI met on a loaded machine)."""
    return drv.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : '';", element_id) or ""


def approx_list(a: list[Any], b: list[Any], rel: float = 1e-6) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return False
        elif abs(x - y) > rel * max(1.0, abs(y)):
            return False
    return True


def click(drv, css: str, timeout: float = WAIT) -> None:
    """Click the element matching ``css``, retrying while Dash re-renders it under us."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    def attempt():
        try:
            els = drv.find_elements("css selector", css)
            if not els:
                return False
            els[0].click()
            return True
        except (StaleElementReferenceException, WebDriverException):
            return False
    wait_until(attempt, timeout=timeout, interval=0.1, what=f"click {css}")


def texts(drv, css: str) -> list[str]:
    """The visible text of every element matching ``css`` (read in one script: never stale)."""
    return drv.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), (e) => e.innerText);", css)
