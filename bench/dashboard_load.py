"""Dashboard page-load benchmark: how soon a 1,000,000-step run's page is usable in a browser.

    .venv/bin/python bench/dashboard_load.py                 # build the run (~1-8 min), then measure
    .venv/bin/python bench/dashboard_load.py --reuse         # measure an existing benchmark run again
    .venv/bin/python bench/dashboard_load.py --reuse --cold 3 --warm 6 --json out.json
    .venv/bin/python bench/dashboard_load.py --ranks 64         # a 64-rank run (100,000 steps per rank)

The run is ``bench/query.py``'s synthetic one (1,000,000 steps x 150 layers, per-layer
grad norms every step, loss spikes and NaNs, written through the server's own write
path) in its own SQLite file, ``bench-data/dashboard-load.db``. A real ``gradwatch
serve`` serves it; Debian's headless Chromium (Selenium, as in the browser tests)
opens ``/runs/<id>``:

- **cold**: a fresh browser profile per visit (nothing cached: plotly.js and the
  Dash bundles are fetched, parsed and compiled);
- **warm**: the same browser visits the page again (HTTP cache and V8's code
  cache filled by the earlier visits), ``about:blank`` in between.

The timestamps are taken in the page, not by polling from Selenium: a script
injected before any page script (``Page.addScriptToEvaluateOnNewDocument``) watches
the DOM with a ``MutationObserver`` and records ``performance.now()`` (ms since
navigation start) when each chart is first drawn by Plotly, and when it is first
drawn with data; it also wraps ``fetch`` to time each Dash callback request
(request sent -> response headers: the server's work plus loopback).

``--ranks N`` measures a run of N ranks instead (``bench-data/dashboard-load-ranks.db``):
every rank sends loss, grad norm, step time … each step (``--steps`` per rank, default
100,000), rank 5 slower than the others; rank 0 also sends the 150 per-layer grad
norms every step and the sparse statistics every 100, as in the single-rank run.
The page then also draws the rank overlays and rank × step heatmaps, and **all**
waits for them too.

Reported per visit, and as medians:

- **usable**: the headline charts (loss, grad norm, loss scale) are drawn with
  their data, and the main thread has come back to the event loop (a task posted
  at that moment has run), so a drag on a chart is handled: the definition in
  docs/dashboard.md ("Big runs");
- **drawn**: the headline charts drawn with data (DOM, before the next task);
- **all**: every chart of the page drawn from the server's figure (the 8 series
  charts, the update ratio and the 3 per-layer heatmaps; a chart the run has no
  data for counts once it shows its "no data" note);
- **DCL**: DOMContentLoaded (the page's scripts, plotly.js included, loaded and run);
- the slowest chart callback (loss / grad norm / ...) and heatmap callback, request to
  response headers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import checkout  # noqa: E402  (bench/, this script's folder)
sys.path.insert(0, str(checkout.shim(ROOT)))   # gradwatch.* is this checkout's code
sys.path.insert(0, str(ROOT / "bench"))

from query import find_or_build_run  # noqa: E402 - bench/ is not a package

HEADLINE = ("run-graph-loss", "run-graph-grad_norm", "run-graph-loss_scale")

# Runs in every document before its own scripts. Times are performance.now(): ms since navigation start.
PROBE_JS = r"""
(function () {
  if (location.protocol === 'about:') { return; }
  var ids = %(ids)s, head = %(head)s;
  var W = window.__gwLoad = {drawn: {}, data: {}, calls: [], usable: null, headDrawn: null, allDrawn: null,
                             longtasks: []};
  function gdOf(id) {
    var el = document.getElementById(id);
    if (!el) { return null; }
    return el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot');
  }
  function check() {
    var now = performance.now();
    ids.forEach(function (id) {
      if (W.data[id] !== undefined) { return; }
      var gd = gdOf(id);
      // A figure from the server has a title (the placeholder has none), drawn as .gtitle.
      if (!gd || !gd._fullLayout || !gd.querySelector('.gtitle')) { return; }
      if (W.drawn[id] === undefined) { W.drawn[id] = now; }
      var lines = gd.querySelectorAll('.scatterlayer path.js-line, .heatmaplayer image, .hm image');
      for (var i = 0; i < lines.length; i++) {
        var d = lines[i].getAttribute('d') || lines[i].getAttribute('href') || lines[i].getAttribute('xlink:href');
        if (d && d.length > 1) { W.data[id] = now; return; }
      }
    });
    if (W.headDrawn === null && head.every(function (id) { return W.data[id] !== undefined; })) {
      W.headDrawn = now;
      // Usable once the main thread is back at the event loop: a drag on a chart is handled then.
      var ch = new MessageChannel();
      ch.port1.onmessage = function () { W.usable = performance.now(); };
      ch.port2.postMessage(0);
    }
    if (W.allDrawn === null && ids.every(function (id) { return W.drawn[id] !== undefined; })) {
      W.allDrawn = now;
      obs.disconnect();
    }
  }
  var obs = new MutationObserver(check);
  obs.observe(document, {subtree: true, childList: true});
  try {
    new PerformanceObserver(function (list) {
      list.getEntries().forEach(function (e) { W.longtasks.push([Math.round(e.startTime), Math.round(e.duration)]); });
    }).observe({type: 'longtask', buffered: true});
  } catch (e) { /* no long-task timing in this browser */ }
  var realFetch = window.fetch;
  window.fetch = function (url, opts) {
    var t0 = performance.now(), out = '';
    try { out = JSON.parse(opts.body).output || ''; } catch (e) { /* not a callback */ }
    return realFetch.apply(this, arguments).then(function (r) {
      W.calls.push({url: String(url), output: String(out).slice(0, 80), sent: t0, headers: performance.now()});
      return r;
    });
  };
})();
"""

RESULT_JS = """
const W = window.__gwLoad;
if (!W) { return null; }
const nav = performance.getEntriesByType('navigation')[0] || {};
return {drawn: W.drawn, data: W.data, calls: W.calls, usable: W.usable, headDrawn: W.headDrawn,
        allDrawn: W.allDrawn, longtasks: W.longtasks, dcl: nav.domContentLoadedEventEnd || null,
        load: nav.loadEventEnd || null,
        resources: performance.getEntriesByType('resource').map((e) => [e.name.replace(location.origin, ''),
          Math.round(e.startTime), Math.round(e.responseEnd), e.transferSize, e.decodedBodySize])};
"""


def chart_ids(ranks: int = 1) -> list[str]:
    from gradwatch.dashboard.figures import HEATMAPS, PANELS, RANK_CHARTS

    per_rank = ([f"run-rank-{kind}-{sig}" for kind in ("graph", "heatmap") for sig, _, _ in RANK_CHARTS]
                if ranks > 1 else [])
    return ([f"run-graph-{p.key}" for p in PANELS] + ["run-graph-update_ratio"]
            + [f"run-heatmap-{stat}" for stat, _ in HEATMAPS] + per_rank)


SLOW_RANK = 5


def build_rank_run(db_url: str, ranks: int, steps: int, batch_steps: int = 2000) -> int:
    """A run of ``ranks`` ranks through the server's write path (rollups included, rules off)."""
    import numpy as np

    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.ingest.write import ingest_batch
    from gradwatch.server.wire.schemas import IngestBatchIn, MetaIn, StepIn
    from gradwatch.server.operations.settings import Settings

    from query import LAYERS, SPARSE_STATS

    if db_url.startswith("sqlite"):
        for suffix in ("", "-wal", "-shm"):
            p = Path(db_url.split("///", 1)[1] + suffix)
            if p.exists():
                p.unlink()
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(data_dir=ROOT / "bench-data", database_url=db_url)
    names = [f"blocks.{i // 6}.p{i % 6}.weight" for i in range(LAYERS)]
    t0 = time.perf_counter()
    run_id = None
    for r in range(ranks):
        rng = np.random.default_rng(r)
        for lo in range(0, steps, batch_steps):
            idx = np.arange(lo, min(lo + batch_steps, steps))
            loss = 3.0 * np.exp(-idx / (steps / 3)) + 0.05 * rng.standard_normal(len(idx))
            st = 0.05 * (3 if r == SLOW_RANK else 1) + 0.002 * rng.random(len(idx))
            gn = np.abs(1.0 + 0.2 * rng.standard_normal((len(idx), LAYERS))).astype("<f4") if r == 0 else None
            objs = []
            for j, i in enumerate(idx.tolist()):
                layers = {}
                if gn is not None:
                    layers = {"grad_norm": gn[j].tobytes()}
                    if i % 100 == 0:
                        layers.update({k: gn[j].tobytes() for k in SPARSE_STATS})
                objs.append(StepIn.model_construct(
                    step=i, time=1.7e9 + i * 0.05, loss=float(loss[j]), grad_norm=0.8 + 0.01 * (i % 7),
                    clip_max_norm=1.0, clipped=False, loss_scale=65536.0, overflow=False, overflow_count=0, lr=3e-4,
                    step_time=float(st[j]), samples_per_s=1000.0, tokens_per_s=None, mem_peak=None,
                    ema_divergence=1e-3, input_nonfinite=0, custom={}, layers=layers))
            meta = (MetaIn.model_construct(param_names=names, module_names=names, bn_names=None, config={},
                                           host=f"node-{r // 8}", local_rank=r % 8, device=f"cuda:{r % 8}")
                    if lo == 0 else None)
            batch = IngestBatchIn.model_construct(batch_id=f"bench-{r}-{lo}", project="bench", run=f"ranks-{ranks}",
                                                  rank=r, world_size=ranks, meta=meta, steps=objs, events=[],
                                                  status=None)
            with database.write_sessionmaker() as session:
                run_id = ingest_batch(session, batch=batch, settings=settings, now=time.time(),
                                      evaluate_rules=False).run_id
                session.commit()
        print(f"  rank {r}: {(r + 1) * steps / (time.perf_counter() - t0):,.0f} steps/s", flush=True)
    database.dispose()
    print(f"built {ranks} ranks x {steps:,} steps in {time.perf_counter() - t0:.0f} s")
    return run_id


def find_rank_run(db_url: str, ranks: int):
    from sqlalchemy import select

    from gradwatch.server.storage.db import open_database
    from gradwatch.server.storage.models import Run

    database = open_database(db_url)
    with database.sessionmaker() as session:
        rid = session.scalar(select(Run.id).where(Run.name == f"ranks-{ranks}"))
    database.dispose()
    return rid


def start_browser(profile: Path, ranks: int = 1):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from tests.conftest import _find_chromium

    binary, driver_path = _find_chromium()
    if not binary or not driver_path:
        raise SystemExit("needs chromium and chromedriver (apt-get install -y chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    # The browser tests' flags (tests/conftest.py) and their window size: two chart columns.
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-dev-shm-usage", "--disable-component-update", "--disable-sync", "--no-first-run",
                "--window-size=1400,1000", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_page_load_timeout(60)
    drv.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                        {"source": PROBE_JS % {"ids": json.dumps(chart_ids(ranks)), "head": json.dumps(list(HEADLINE))}})
    return drv


def visit(drv, url: str, timeout: float = 60.0) -> dict:
    """Open the page, wait until every chart is drawn, return the in-page timings."""
    drv.get("about:blank")
    drv.get(url)
    deadline = time.monotonic() + timeout
    while True:
        r = drv.execute_script(RESULT_JS)
        # The polling interval only bounds how long we wait; the figures come from the page's own clock.
        if r and r["allDrawn"] is not None and r["usable"] is not None:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"page not fully drawn after {timeout:.0f} s: {r}")
        time.sleep(0.1)
    time.sleep(0.3)  # let the last callbacks' timings land
    r = drv.execute_script(RESULT_JS)
    return summarise(r)


def summarise(r: dict) -> dict:
    def slowest(pred):
        ts = [c["headers"] - c["sent"] for c in r["calls"]
              if "_dash-update-component" in c["url"] and pred(c["output"])]
        return max(ts) if ts else None

    first_charts = [c for c in r["calls"] if "run-graph-loss.figure" in c["output"]]
    return {
        "usable": r["usable"],
        "drawn": r["headDrawn"],
        "all": r["allDrawn"],
        "dcl": r["dcl"],
        "charts_request_sent": first_charts[0]["sent"] if first_charts else None,
        "charts_server": slowest(lambda o: "run-graph-" in o and "heatmap" not in o and "update_ratio" not in o),
        "heatmaps_server": slowest(lambda o: "heatmap" in o),
        "longtask_ms": sum(d for _, d in r["longtasks"]),
        "per_chart_drawn": {k: round(v) for k, v in sorted(r["drawn"].items(), key=lambda kv: kv[1])},
        "longtasks": r["longtasks"],
        "resources": r["resources"],
        "calls": [{"output": c["output"], "sent": round(c["sent"]), "ms": round(c["headers"] - c["sent"])}
                  for c in r["calls"] if "_dash-update-component" in c["url"]],
    }


def wait_healthy(base: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit("server exited")
        try:
            with urllib.request.urlopen(base + "/api/health", timeout=5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("server did not start")


def fmt(v) -> str:
    return "     -" if v is None else f"{v:6.0f}"


COLUMNS = ("usable", "drawn", "all", "dcl", "charts_server", "heatmaps_server")


def report(label: str, visits: list[dict]) -> dict:
    print(f"{label}:")
    print("  visit " + " ".join(f"{c:>9s}" for c in ("usable", "drawn", "all", "DCL", "charts-srv", "heatmap-srv")))
    for i, v in enumerate(visits, 1):
        print(f"  {i:5d} " + " ".join(f"{fmt(v[c]):>9s}" for c in COLUMNS))
    med = {c: statistics.median([v[c] for v in visits if v[c] is not None] or [0]) for c in COLUMNS}
    print("  median" + " ".join(f"{fmt(med[c]):>9s}" for c in COLUMNS) + "   (ms since navigation start)")
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="default: bench-data/dashboard-load.db (dashboard-load-ranks.db with --ranks)")
    ap.add_argument("--steps", type=int, help="default: 1,000,000 (per rank with --ranks: 100,000)")
    ap.add_argument("--ranks", type=int, default=1, help="a run of this many ranks (e.g. 64)")
    ap.add_argument("--reuse", action="store_true", help="keep an existing benchmark run")
    ap.add_argument("--cold", type=int, default=3, help="cold visits (a fresh browser profile each)")
    ap.add_argument("--warm", type=int, default=5, help="warm visits (one browser, after the cold ones)")
    ap.add_argument("--port", type=int, default=8478)
    ap.add_argument("--json", type=Path, help="write every visit's figures here")
    ap.add_argument("--verbose", action="store_true", help="print each visit's callbacks and chart draw times")
    args = ap.parse_args()
    from gradwatch.server.operations.settings import normalize_db_url

    many = args.ranks > 1
    args.db = args.db or f"sqlite:///{ROOT / 'bench-data' / ('dashboard-load-ranks.db' if many else 'dashboard-load.db')}"
    args.steps = args.steps or (100_000 if many else 1_000_000)
    db = normalize_db_url(args.db)
    (ROOT / "bench-data").mkdir(exist_ok=True)
    if many:
        run_id = (find_rank_run(db, args.ranks) if args.reuse else None) or build_rank_run(db, args.ranks, args.steps)
    else:
        run_id = find_or_build_run(db, args.steps, reuse=args.reuse)
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(ROOT / "bench-data"), **checkout.pythonpath(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--db", db, "--port", str(args.port),
                             "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    url = f"{base}/runs/{run_id}"
    results: dict = {"url": url, "steps": args.steps, "ranks": args.ranks, "cold": [], "warm": []}
    browsers = []
    try:
        wait_healthy(base, proc)
        print(f"run {run_id}: {args.ranks} rank(s) x {args.steps:,} steps; {url}; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        with tempfile.TemporaryDirectory(prefix="gw-dashboard-load-") as tmp:
            # One unmeasured visit first: the server's own first-request costs (imports, SQLite
            # pages into the OS cache) are not what a browser visit costs.
            drv = start_browser(Path(tmp) / "warmup", args.ranks)
            browsers.append(drv)
            visit(drv, url)
            drv.quit()
            browsers.remove(drv)
            for i in range(args.cold):
                drv = start_browser(Path(tmp) / f"cold-{i}", args.ranks)
                browsers.append(drv)
                results["cold"].append(visit(drv, url))
                if i < args.cold - 1:
                    drv.quit()
                    browsers.remove(drv)
            # Warm: the last cold browser visits again (its cache and code cache are filled).
            if not browsers:
                drv = start_browser(Path(tmp) / "warm", args.ranks)
                browsers.append(drv)
                visit(drv, url)
            for _ in range(args.warm):
                results["warm"].append(visit(drv, url))
            for label in ("cold", "warm"):
                if results[label]:
                    results[label + "_median"] = report(f"{label} ({len(results[label])} visits)", results[label])
                    if args.verbose:
                        for v in results[label]:
                            print("   ", v["per_chart_drawn"])
                            print("   ", v["calls"])
                            print("    long tasks", v["longtasks"])
                            print("    resources", v["resources"])
            print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        for drv in browsers:
            try:
                drv.quit()
            except Exception:  # noqa: BLE001 - already gone
                pass
        proc.terminate()
        proc.wait(timeout=20)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
