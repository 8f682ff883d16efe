"""Live latency: how long after a training step ends it shows on an open run page.

    .venv/bin/python bench/live_latency.py                          # this checkout, 2 rounds
    git worktree add /tmp/base REV
    .venv/bin/python bench/live_latency.py --base /tmp/base         # REV and this checkout, alternated

Per round and checkout: a real ``gradwatch serve`` on an empty SQLite file; a real training loop
(``bench/live_loop.py``: a tiny MLP under a GradScaler, ``--rate`` steps/s, 10 by default, the
time spent inside each step or, ``--pace idle``, after it; with that checkout's agent) writing each step's end time; Debian's headless Chromium on the run page.
A script in the page reads the loss chart every 20 ms and records, by the page's clock
(``Date.now()``, the same wall clock as the loop's ``time.time()`` on one machine), when each step
first appears in it. Measured: the steps after the page has drawn and ``--settle`` seconds more
(the page's first load is page-load time, bench/dashboard_load.py); latency = first seen - step end.

Printed: p50 / p95 / max per checkout over all its rounds, and the ratio this / base side by side.
Target (issue 17): p95 <= 0.5 s at 10 steps/s.
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
sys.path.insert(0, str(ROOT / "bench"))
import checkout  # noqa: E402  (bench/, this script's folder)

from dashboard_load import start_browser, wait_healthy  # noqa: E402

# The page's own watcher: every 20 ms, the largest step of the loss chart's "loss" trace; each step
# first seen gets the page's wall clock (ms).
WATCH_JS = r"""
if (!window.__gwSeen) {
  window.__gwSeen = {};
  var top = -1;
  setInterval(function () {
    var el = document.getElementById('run-graph-loss');
    var gd = el && (el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot'));
    if (!gd || !gd.data) { return; }
    var now = Date.now();
    for (var t = 0; t < gd.data.length; t++) {
      var tr = gd.data[t];
      if (tr.name !== 'loss' || !tr.x) { continue; }
      for (var i = tr.x.length - 1; i >= 0 && tr.x[i] > top; i--) {
        if (!(tr.x[i] in window.__gwSeen)) { window.__gwSeen[tr.x[i]] = now; }
      }
      if (tr.x.length) { top = Math.max(top, tr.x[tr.x.length - 1]); }
    }
  }, 20);
}
return true;
"""


LOSS_X_JS = r"""
var el = document.getElementById('run-graph-loss');
var gd = el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot');
for (var t = 0; t < gd.data.length; t++) { if (gd.data[t].name === 'loss') { return gd.data[t].x; } }
return [];
"""


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def one_round(root: Path, label: str, args, tmp: Path, k: int) -> list[float]:
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp), **checkout.pythonpath(root))
    port = args.port + k
    base = f"http://127.0.0.1:{port}"
    db = f"sqlite:///{tmp / f'live-{k}.db'}"
    server = subprocess.Popen([sys.executable, "-m", checkout.server_module(root), "serve", "--db", db,
                               "--port", str(port), "--log-level", "warning"], cwd=tmp, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    loop = drv = None
    ends_file = tmp / f"ends-{k}.txt"
    try:
        wait_healthy(base, server)
        run = f"live-{label}-{k}"
        loop = subprocess.Popen([sys.executable, str(ROOT / "bench" / "live_loop.py"), base, run, str(args.steps),
                                 str(args.rate), str(ends_file), args.pace], cwd=tmp, env=env)
        run_id = None
        for _ in range(300):
            runs = _get(f"{base}/api/v1/runs?project=live-latency")
            runs = runs.get("runs", runs) if isinstance(runs, dict) else runs
            if runs:
                run_id = runs[0]["id"]
                break
            time.sleep(0.1)
        if run_id is None:
            raise SystemExit(f"{label}: the run did not appear")
        drv = start_browser(tmp / f"profile-{k}")
        drv.get(f"{base}/runs/{run_id}")
        deadline = time.monotonic() + 60
        while not drv.execute_script(WATCH_JS + "") or not drv.execute_script(
                "return Object.keys(window.__gwSeen || {}).length"):
            if time.monotonic() > deadline:
                raise SystemExit(f"{label}: the loss chart was not drawn")
            time.sleep(0.1)
        drawn_at = time.time()
        loop.wait(timeout=args.steps / args.rate + 60)
        time.sleep(2.0)   # the last steps reach the page
        seen = {int(float(s)): ms / 1000.0 for s, ms in drv.execute_script("return window.__gwSeen").items()}
        ends = {}
        for line in ends_file.read_text().splitlines():
            step, t = line.split()
            ends[int(step)] = float(t)
        measured = [s for s, t in ends.items() if t > drawn_at + args.settle]
        missing = [s for s in measured if s not in seen]
        if missing:
            print(f"  {label}: {len(missing)} of {len(measured)} measured steps never showed "
                  f"(first {missing[:5]})", flush=True)
            xs = drv.execute_script(LOSS_X_JS)
            for s in missing[:3]:
                near = [x for x in xs if abs(x - s) <= 3]
                print(f"    the loss chart's steps near {s}: {near}", flush=True)
        return [seen[s] - ends[s] for s in measured if s in seen]
    finally:
        if drv is not None:
            drv.quit()
        if loop is not None and loop.poll() is None:
            loop.kill()
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="another checkout (a git worktree of an earlier commit) to compare")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per checkout, alternated")
    ap.add_argument("--steps", type=int, default=250, help="steps per round")
    ap.add_argument("--rate", type=float, default=10.0, help="steps per second")
    ap.add_argument("--pace", choices=("compute", "idle"), default="compute",
                    help="where the loop spends a step's time: in the step (compute) or after it (idle: the "
                         "worst case for the agent's hand-over of an ended step; bench/live_loop.py)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the page is drawn before measuring")
    ap.add_argument("--port", type=int, default=8490)
    args = ap.parse_args()
    sides = [("base", args.base.resolve())] if args.base else []
    sides.append(("this", ROOT))
    lat: dict[str, list[float]] = {label: [] for label, _ in sides}
    print(f"live latency at {args.rate:g} steps/s ({args.pace}), {args.steps} steps x {args.rounds} rounds per checkout; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gw-live-") as tmp:
        k = 0
        for r in range(args.rounds):
            for label, root in sides:
                xs = one_round(root, label, args, Path(tmp), k)
                k += 1
                lat[label].extend(xs)
                print(f"  round {r + 1} {label}: {len(xs)} steps, p50 {statistics.median(xs):.3f} s, "
                      f"p95 {pct(xs, 0.95):.3f} s, max {max(xs):.3f} s", flush=True)
    print(f"{'checkout':10} {'steps':>6} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    for label, xs in lat.items():
        print(f"{label:10} {len(xs):6d} {statistics.median(xs):7.3f} {pct(xs, 0.95):7.3f} {max(xs):7.3f}")
    if args.base:
        a, b = lat["this"], lat["base"]
        print(f"ratio this / base: p50 {statistics.median(a) / statistics.median(b):.2f}, "
              f"p95 {pct(a, 0.95) / pct(b, 0.95):.2f}")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
