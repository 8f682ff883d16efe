"""The run page of multi-rank runs in headless Chromium: the rank picker, every rank overlaid with the odd
one highlighted, the rank × step heatmaps, where each rank runs in the header, picking a rank, a sharded
run's grad norm read from its combined row, and a 64-rank run drawn whole."""
from __future__ import annotations

import math
import uuid

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import (WAIT, approx_list, choose_option, graph, severe_console_entries, text_of,
                                      wait_trace)
from tests.dashboard.runs_feed import MODULE_NAMES, PARAM_NAMES, make_steps

pytestmark = pytest.mark.browser

LINES_JS = """
const el = document.getElementById(arguments[0]);
const gd = el && el.querySelector('.js-plotly-plot');
if (!gd || !gd.data) { return null; }
return {lines: gd.data.map((t) => [t.name, t.line ? t.line.width : null, t.line ? t.line.color : null]),
        title: gd.layout.title && gd.layout.title.text};
"""

HOVER_JS = """
const gd = document.getElementById(arguments[0]).querySelector('.js-plotly-plot');
Plotly.Fx.hover(gd, [{curveNumber: arguments[1], pointNumber: arguments[2]}]);
const h = gd.querySelector('.hoverlayer');
return h ? h.textContent : '';
"""

SLOW = 2            # the rank that is slowed (3× step time) and off (loss +0.8) in the 4-rank run


def _post_rank(server, *, run: str, rank: int, world: int, steps: list[dict], meta: dict, status=None) -> int:
    body = {"batch_id": uuid.uuid4().hex, "project": "ranks", "run": run, "rank": rank, "world_size": world,
            "steps": steps, "meta": meta}
    if status:
        body["status"] = status
    code, answer = server.post("/api/v1/ingest", body)
    assert code == 200, f"ingest answered {code}: {answer}"
    return answer["run_id"]


def _rank_steps(rank: int, n: int, *, slow: bool = False) -> list[dict]:
    steps = make_steps(n, seed=rank, layers_every=10)
    for s in steps:
        if slow:
            s["step_time"] *= 3
            s["loss"] += 0.8
    return steps


def _meta(rank: int, **extra) -> dict:
    return {"param_names": PARAM_NAMES, "module_names": MODULE_NAMES, "config": {"max_norm": 1.0},
            "host": "node-a" if rank < 2 else "node-b", "local_rank": rank % 2, "device": f"cuda:{rank % 2}",
            **extra}


def _lines(drv, graph_id: str) -> dict:
    return drv.execute_script(LINES_JS, graph_id) or {"lines": [], "title": ""}


def _heatmap(drv, graph_id: str, what: str) -> dict:
    return wait_until(lambda: (g := graph(drv, graph_id)) and g["data"] and g["data"][0].get("y") and g,
                      timeout=WAIT, what=what)


def test_four_ranks_overlay_heatmap_header_and_picker(shared_server, browser):
    n = 200
    per_rank = {r: _rank_steps(r, n, slow=r == SLOW) for r in range(4)}
    for r in range(4):
        run_id = _post_rank(shared_server, run="four-ranks", rank=r, world=4, steps=per_rank[r], meta=_meta(r),
                            status="finished" if r == 3 else None)

    # the API lists where each rank runs
    code, ranks = shared_server.get(f"/api/v1/runs/{run_id}/ranks")
    assert code == 200
    assert [(r["rank"], r["host"], r["local_rank"], r["device"]) for r in ranks["ranks"]] == [
        (0, "node-a", 0, "cuda:0"), (1, "node-a", 1, "cuda:1"), (2, "node-b", 0, "cuda:0"), (3, "node-b", 1, "cuda:1")]

    browser.get(f"{shared_server.url}/runs/{run_id}")

    # every rank overlaid on the step-time chart, one legend entry each; the slowed rank highlighted
    st = wait_trace(browser, "run-rank-graph-step_time", f"rank {SLOW}", lambda t: len(t["x"]) == n,
                    what="step time per rank drawn")
    assert approx_list(st["y"], [s["step_time"] for s in per_rank[SLOW]])
    fig = graph(browser, "run-rank-graph-step_time")
    assert {f"rank {r}" for r in range(4)} <= {t["name"] for t in fig["data"]}
    lines = _lines(browser, "run-rank-graph-step_time")
    widths = {name: w for name, w, _ in lines["lines"] if name.startswith("rank ")}
    assert widths[f"rank {SLOW}"] > max(w for name, w in widths.items() if name != f"rank {SLOW}")
    assert f"rank {SLOW} highlighted" in lines["title"]
    loss_lines = _lines(browser, "run-rank-graph-loss")
    assert f"rank {SLOW} highlighted" in loss_lines["title"]

    # rank × step heatmaps: rank on y, the ranks' own values in the cells
    heat = _heatmap(browser, "run-rank-heatmap-loss", "loss heatmap")
    cells = heat["data"][0]
    assert cells["y"] == [0, 1, 2, 3]
    assert cells["x"] == list(range(n))
    for r in range(4):
        assert approx_list(cells["z"][r], [s["loss"] for s in per_rank[r]])
    st_heat = _heatmap(browser, "run-rank-heatmap-step_time", "step-time heatmap")["data"][0]
    assert approx_list(st_heat["z"][SLOW], [s["step_time"] for s in per_rank[SLOW]])
    gn_heat = _heatmap(browser, "run-rank-heatmap-grad_norm", "grad-norm heatmap")["data"][0]
    assert math.isclose(gn_heat["z"][1][5], math.log10(per_rank[1][5]["grad_norm"]), rel_tol=1e-6)

    # the header says where each rank runs
    hosts = wait_until(lambda: (t := text_of(browser, "run-rank-hosts")) and "node-b" in t and t, timeout=WAIT,
                       what="ranks' hosts in the header")
    assert "4 ranks on 2 hosts" in hosts and "node-a" in hosts and "cuda:1" in hosts

    # the main charts read rank 0 ...
    loss = wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == n, what="loss drawn")
    assert approx_list(loss["y"], [s["loss"] for s in per_rank[0]])
    save_screenshot(browser, "run-page-ranks")
    browser.execute_script("document.getElementById('run-ranks-section').scrollIntoView();")
    save_screenshot(browser, "run-page-ranks-overlay")
    browser.execute_script("window.scrollTo(0, 0);")

    # ... until a rank is picked: every chart redraws with that rank's data, the overlay highlights it
    choose_option(browser, "run-rank", "rank 3 · node-b cuda:1")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: approx_list(t["y"], [s["loss"] for s in per_rank[3]]),
               what="loss of rank 3")
    wait_trace(browser, "run-graph-step_time", "step time",
               lambda t: approx_list(t["y"], [s["step_time"] for s in per_rank[3]]), what="step time of rank 3")
    wait_until(lambda: "rank 3 highlighted" in (_lines(browser, "run-rank-graph-loss")["title"] or ""),
               timeout=WAIT, what="rank 3 highlighted on the overlay")
    assert not severe_console_entries(browser)


def test_sharded_run_reads_grad_norm_from_the_combined_row(shared_server, browser):
    """Under FSDP rank 0's grad_norm is not measured by design: the chart reads rank -1's global norm."""
    n = 60
    halves = {r: [[(0.3 + 0.1 * k + 0.01 * i) * (1 + r) for k in range(len(PARAM_NAMES))] for i in range(n)]
              for r in range(2)}
    for r in range(2):
        steps = make_steps(n, seed=r, layers_every=0)
        for i, s in enumerate(steps):
            s["grad_norm"] = None
            s["clipped"] = None
            s["grad_norm_local"] = math.sqrt(sum(v * v for v in halves[r][i]))
            s["layers"] = {"grad_norm_local": halves[r][i]}
        run_id = _post_rank(shared_server, run="sharded", rank=r, world=2, steps=steps,
                            meta=_meta(r, param_shards=[[r, 2]] * len(PARAM_NAMES)))
    expected = [math.sqrt(sum(a * a + b * b for a, b in zip(halves[0][i], halves[1][i]))) for i in range(n)]

    browser.get(f"{shared_server.url}/runs/{run_id}")
    gn = wait_trace(browser, "run-graph-grad_norm", "grad norm", lambda t: len(t["x"]) == n, what="grad norm drawn")
    assert approx_list(gn["y"], expected, rel=1e-5)
    # per rank: what each rank measured of its shard (the combined value is one number for all ranks)
    local = wait_trace(browser, "run-rank-graph-grad_norm", "rank 1", lambda t: len(t["x"]) == n,
                       what="grad norm of each rank's shard")
    assert approx_list(local["y"], [math.sqrt(sum(v * v for v in halves[1][i])) for i in range(n)], rel=1e-5)
    assert "each rank's shard" in _lines(browser, "run-rank-graph-grad_norm")["title"]
    heat = _heatmap(browser, "run-heatmap-grad_norm", "combined per-parameter grad norms")["data"][0]
    assert heat["y"] == PARAM_NAMES
    assert math.isclose(heat["z"][0][0], math.log10(math.hypot(halves[0][0][0], halves[1][0][0])), rel_tol=1e-5)
    assert not severe_console_entries(browser)


def test_sixty_four_ranks_page_draws_every_chart(shared_server, browser):
    from gradwatch.dashboard import figures

    # the run page's charts (importing dashboard.pages.run outside an app is refused by Dash)
    all_graph_ids = ([f"run-graph-{p.key}" for p in figures.PANELS] + ["run-graph-update_ratio"]
                     + [f"run-heatmap-{stat}" for stat, _ in figures.HEATMAPS]
                     + [f"run-rank-{kind}-{sig}" for kind in ("graph", "heatmap") for sig, _, _ in figures.RANK_CHARTS])

    world, n = 64, 100
    for r in range(world):
        steps = _rank_steps(r, n, slow=r == 41)
        run_id = _post_rank(shared_server, run="sixty-four", rank=r, world=world, steps=steps,
                            meta=_meta(r, host=f"node-{r // 8}", local_rank=r % 8, device=f"cuda:{r % 8}"))
    browser.get(f"{shared_server.url}/runs/{run_id}")

    def drawn(gid):
        g = graph(browser, gid)
        return g is not None and g["data"] and any(t["x"] for t in g["data"])
    for gid in all_graph_ids:
        wait_until(lambda: drawn(gid), timeout=WAIT, what=f"{gid} drawn")
    overlay = graph(browser, "run-rank-graph-step_time")
    names = [t["name"] for t in overlay["data"]]
    assert names == ["other ranks", "rank 41", "NaN / Inf"]     # 63 grey lines in one trace, the slow one on top
    grey = overlay["data"][0]
    assert {r for r in grey["customdata"] if r is not None} == set(range(world)) - {41}
    widths = {name: w for name, w, _ in _lines(browser, "run-rank-graph-step_time")["lines"]}
    assert widths["rank 41"] > widths["other ranks"]
    # hovering a grey line names its rank
    k = max(i for i, r in enumerate(grey["customdata"]) if r == 17)
    assert browser.execute_script(HOVER_JS, "run-rank-graph-step_time", 0, k).startswith("rank 17: ")
    assert _heatmap(browser, "run-rank-heatmap-step_time", "64-rank heatmap")["data"][0]["y"] == list(range(world))
    assert "64 ranks on 8 hosts" in text_of(browser, "run-rank-hosts")
    browser.execute_script("document.getElementById('run-ranks-section').scrollIntoView();")
    save_screenshot(browser, "run-page-64-ranks")
    assert not severe_console_entries(browser)
