"""What every step chart shares: alerts, checkpoints and rewinds as vertical lines, the signatures that
tell a callback whether they changed, and the x axis (a range the user zoomed to, or autorange)."""
from __future__ import annotations

from typing import Optional, Sequence

from gradwatch.dashboard import theme

MAX_ALERT_MARKS = 60  # vertical alert lines per chart; older ones are dropped
MAX_CHECKPOINT_MARKS = 60  # vertical checkpoint lines per chart; the latest are kept (a rollback names a late one)
MAX_REWIND_MARKS = 30  # rewinds per chart (max_rewinds is a handful); the latest are kept


def alert_shapes(alerts: Sequence[dict]) -> list[dict]:
    """A dotted vertical line, labelled with the rule id, at the step where each alert started."""
    marks = sorted(alerts, key=lambda a: a.get("first_step") or a.get("step") or 0)[-MAX_ALERT_MARKS:]
    shapes = []
    for a in marks:
        step = a.get("first_step", a.get("step"))
        if step is None:
            continue
        colour = theme.SEVERITY_COLOURS.get(a.get("severity"), theme.MUTED)
        shapes.append({
            "type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
            "line": {"color": colour, "width": 1, "dash": "dot"}, "layer": "above",
            "label": {"text": str(a.get("rule", "")), "textposition": "end", "yanchor": "top",
                      "font": {"size": 9, "color": colour}},
        })
    return shapes


def checkpoint_shapes(checkpoints: Sequence[dict]) -> list[dict]:
    """A thin solid vertical line, labelled "ckpt <step>" at the chart's foot, at each checkpoint's step
    (``GET /api/v1/runs/{id}/checkpoints``; the step a resume from it continues with). Drawn under the
    traces and apart from the alerts' dotted lines, so a rollback's checkpoint reads off the same axis."""
    marks = sorted((c for c in checkpoints if c.get("step") is not None), key=lambda c: c["step"])
    shapes = []
    for c in marks[-MAX_CHECKPOINT_MARKS:]:
        step = c["step"]
        shapes.append({
            "type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
            "line": {"color": theme.CHECKPOINT_COLOUR, "width": 1}, "opacity": 0.55, "layer": "below",
            "name": f"checkpoint {step}",
            "label": {"text": f"ckpt {step:,}", "textposition": "start", "yanchor": "bottom",
                      "font": {"size": 9, "color": theme.CHECKPOINT_COLOUR}},
        })
    return shapes


def rewind_label(rewind: dict) -> str:
    """The mark's words: ``rewind → 300``, ``LR ×0.5`` (a cooled LR, no rewind) or ``gave up``."""
    action = rewind.get("action")
    if action == "rewind" and rewind.get("to_step") is not None:
        return f"rewind → {rewind['to_step']:,}"
    if action == "cool":
        return f"LR ×{float(rewind.get('lr_factor') or 1.0):g}"
    return "gave up" if action == "gave_up" else str(action or "rewind")


def rewind_shapes(rewinds: Sequence[dict]) -> list[dict]:
    """Each rewind (``GET /api/v1/runs/{id}/rewinds``) as a dash-dot vertical line at the step it was made,
    labelled ``rewind → <to_step>`` mid-height (apart from the alerts' labels at the top and the
    checkpoints' at the foot), and a faint band from ``to_step`` to it: the stretch whose updates the
    rewind threw away (the step axis goes on from where it was; the steps are not re-numbered)."""
    marks = sorted((r for r in rewinds if r.get("step") is not None), key=lambda r: r["step"])
    shapes = []
    for r in marks[-MAX_REWIND_MARKS:]:
        step = r["step"]
        if r.get("action") == "rewind" and r.get("to_step") is not None and r["to_step"] < step:
            shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": r["to_step"], "x1": step,
                           "y0": 0, "y1": 1, "fillcolor": theme.REWIND_COLOUR, "opacity": 0.08,
                           "line": {"width": 0}, "layer": "below", "name": f"rewound-away {r['to_step']}-{step}"})
        shapes.append({
            "type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
            "line": {"color": theme.REWIND_COLOUR, "width": 1.5, "dash": "dashdot"}, "layer": "above",
            "name": f"rewind {step}",
            "label": {"text": rewind_label(r), "textposition": "middle", "yanchor": "bottom",
                      "font": {"size": 9, "color": theme.REWIND_COLOUR}},
        })
    return shapes


def rewinds_signature(rewinds: Sequence[dict]) -> list:
    return [[r.get("step"), r.get("action"), r.get("to_step")] for r in rewinds]


def step_marks(alerts: Sequence[dict] = (), checkpoints: Sequence[dict] = (), rewinds: Sequence[dict] = ()) -> list:
    """Every vertical mark of a step chart: alerts, checkpoints, rewinds."""
    return alert_shapes(alerts) + checkpoint_shapes(checkpoints) + rewind_shapes(rewinds)


def checkpoints_signature(checkpoints: Sequence[dict]) -> list:
    return [[c.get("step"), c.get("path")] for c in checkpoints]


def alerts_signature(alerts: Sequence[dict]) -> list:
    """What, in a run's alerts, changes what the page shows (cheap to compare in a Store)."""
    return [[a.get("id"), a.get("status"), bool(a.get("acknowledged")), a.get("last_step"), a.get("suppressed_by"),
             a.get("silenced_by"), a.get("muted")] for a in alerts]


def _x_axis(x_range: Optional[Sequence[float]]) -> dict:
    if x_range:
        return {"range": list(x_range), "autorange": False}
    return {"autorange": True}
