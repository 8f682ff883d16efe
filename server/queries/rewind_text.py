"""The one sentence that says what a ``rewind`` event did (docs/wire-format.md, "The rewind event").

Leaf module (standard library only). Every place that shows a rewind says it with :func:`rewind_text`:
the ``/rewinds`` listing, the incident timeline, the webhook and email notification, the trigger alert's
"acted on" line that the training loop reads back (``monitor.alerts()``), and the dashboard's card.

``trigger`` is who it acted on; the server passes the stored alert's rule, name and first step when the
event names an alert it has (the agent's copy may be older), so the words match the alert the user sees.

    >>> data = {"action": "rewind", "from_step": 412, "to_step": 300, "batches_skipped": 112, "lr_factor": 0.5,
    ...         "cool_steps": 200, "rewind_number": 1, "max_rewinds": 3}
    >>> rewind_text(data, trigger={"rule": "A1", "name": "loss_nonfinite", "step": 405})
    'rewound to step 300, skipped 112 batches, LR ×0.5 for 200 steps (A1 loss_nonfinite at step 405; rewind 1 of 3)'
    >>> rewind_text({"action": "gave_up", "from_step": 900, "rewind_number": 3, "max_rewinds": 3, "then": "stop"})
    'gave up at step 900 after 3 of 3 rewinds: the run stops'
"""
from __future__ import annotations

from typing import Any, Optional

ACTIONS = ("rewind", "cool", "gave_up")


def _count(n: Any, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _factor(x: Any) -> str:
    return f"×{float(x):g}"


def _lr(data: dict) -> str:
    factor, steps = data.get("lr_factor", 1.0), data.get("cool_steps") or 0
    if factor in (None, 1, 1.0) or not steps:
        return "LR unchanged"
    return f"LR {_factor(factor)} for {_count(steps, 'step', 'steps')}"


def trigger_words(trigger: Optional[dict]) -> str:
    """``A1 loss_nonfinite at step 405`` (what is known of it); "" for none."""
    if not trigger:
        return ""
    who = " ".join(str(trigger[k]) for k in ("rule", "name") if trigger.get(k))
    if trigger.get("step") is not None:
        who = f"{who} at step {int(trigger['step']):,}".strip()
    return who


def rewind_text(data: dict, *, trigger: Optional[dict] = None) -> str:
    """What the remediation did, in one lower-case clause; ``trigger`` defaults to ``data["trigger"]``."""
    action = data.get("action")
    trigger = data.get("trigger") if trigger is None else trigger
    of = []
    if action == "rewind":
        skipped = data.get("batches_skipped")
        if skipped is None and data.get("to_step") is not None:
            skipped = int(data["from_step"]) - int(data["to_step"])
        text = f"rewound to step {int(data['to_step']):,}, skipped {_count(skipped, 'batch', 'batches')}, {_lr(data)}"
        if data.get("rewind_number") and data.get("max_rewinds"):
            of.append(f"rewind {data['rewind_number']} of {data['max_rewinds']}")
    elif action == "cool":
        lr = _lr(data)
        text = f"cooled the {lr}, no rewind" if lr != "LR unchanged" else "no rewind, LR unchanged"
    else:
        used = (f" after {data.get('rewind_number')} of {data['max_rewinds']} rewinds"
                if data.get("max_rewinds") is not None and data.get("rewind_number") is not None else "")
        then = {"stop": ": the run stops", "continue": ": training goes on without remediation"}.get(
            data.get("then"), "")
        # giving up with then="stop" may first restore the last good snapshot (the state a checkpoint keeps)
        back = (f", restored step {int(data['to_step']):,}" if data.get("to_step") is not None
                and int(data["to_step"]) < int(data["from_step"]) else "")
        text = f"gave up at step {int(data['from_step']):,}{used}{back}{then}"
    who = trigger_words(trigger)
    parts = [p for p in (who, *of) if p]
    return f"{text} ({'; '.join(parts)})" if parts else text


def acted_on_text(data: dict) -> str:
    """The line the trigger alert gets (first of its actions): what was already done about it, and when.

    >>> acted_on_text({"action": "cool", "from_step": 50, "lr_factor": 0.5, "cool_steps": 100})
    'Acted on at step 50 by the Rewind policy: cooled the LR ×0.5 for 100 steps, no rewind.'
    """
    return f"Acted on at step {int(data['from_step']):,} by the Rewind policy: {rewind_text(data, trigger={})}."
