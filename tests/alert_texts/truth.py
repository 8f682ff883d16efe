"""The truth check: every word an alert says is true of its run (issue 42).

``check_run(get, run_id)`` reads one run through the public API (its alerts, each alert's incident,
its events and the stored series at the steps the texts name) and returns the lies it found, one
sentence each. It checks, for every alert:

1. **Numbers.** A number a message, diagnosis or action ties to a step ("Loss is NaN at step 400",
   "Grad norm 157.4 at step 240", "loss scale 4096 at step 404", "last grad norm 0.1594") equals the
   stored value at that step, as the texts write numbers (``fmt``: 4 significant digits). A number
   said to hold "now" must hold at the alert's last step. The evidence's own ``loss`` / ``grad_norm``
   / ``loss_scale`` equal the stored values at the first step, ``evidence.last``'s at the last one.
2. **No contradiction** on one alert (its message, diagnosis and actions together): a NaN "while the
   grad norm was normal" beside "grad norm exploded first".
3. **No advice the run already follows**: "enable gradient clipping" on a run that clips (its
   ``run_setup`` event or the stored ``clip_max_norm``), a rollback / skip-the-batch on an episode whose
   every step the loss scaler skipped (the weights never took those updates), "add an EMA" on a run
   with one.
4. **"What deviated first" agrees with the timeline** of the alert's incident page: "no signal left its
   normal band in the N steps before … nothing drifted" while another warning or critical alert of the
   run started in those N steps is a lie; a precursor the sentence names "from step S" is on the
   timeline at S.
5. **What the Rewind policy did** (issue 44): an "Acted on at step S by the Rewind policy: …" line is a
   stored rewind of the run (``/rewinds``) made at S on this alert, and its numbers are that rewind's
   ("rewound to step N, skipped K batches, LR ×F for C steps"; K is S − N); the latest rewind that acted
   on an alert is said on it.

Decided here: a number is compared after formatting the stored value the way the texts do
(``server.rules.stats.fmt``), so "157.4" matches 157.356; counts and thresholds that are settings
(the 200 of "the last 200 steps") are not data and are not checked.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

from gradwatch.server.rules.stats import fmt

Get = Callable[[str], Any]      # path -> parsed JSON body

NUM = r"(-?(?:NaN|-?Inf|\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?))"
STEP = r"([\d,]+)"
# (pattern, signal, which group is the value, which the step) over a message / diagnosis / action
STEP_CLAIMS = [
    (re.compile(rf"\bLoss is {NUM} at step {STEP}"), "loss"),
    (re.compile(rf"\bLoss spike {NUM} at step {STEP}"), "loss"),
    (re.compile(rf"\bGrad norm (?:is )?{NUM} at step {STEP}"), "grad_norm"),
    (re.compile(rf"\b[Ll]oss scale (?:fell to |is |of )?{NUM}(?: \(< [\d.e+-]+\))? at step {STEP}"), "loss_scale"),
]
NOW_CLAIMS = [(re.compile(rf"\(now {NUM}\)"), "loss_scale")]
CLIP_ADVICE = re.compile(r"\b(?:[Ee]nable (?:gradient )?clipping|[Cc]lip (?:the )?gradients\b)")
ROLLBACK_ADVICE = re.compile(r"\b(?:[Rr]oll(?:ing)? back to|skip(?:ping)? (?:that|the) batch|skip batches)")
EMA_ADVICE = re.compile(r"\b(?:[Aa]dd|[Uu]se|[Kk]eep) an EMA\b")
NOTHING_DRIFTED = re.compile(r"no signal left its normal band in the ([\d,]+) steps before")
FROM_STEP = re.compile(r" from step ([\d,]+), ")
DEVIATED = "What deviated first: "
ACTED_ON = re.compile(r"^Acted on at step ([\d,]+) by the Rewind policy: (.*)$", re.S)
REWOUND = re.compile(r"rewound to step ([\d,]+), skipped ([\d,]+) batch(?:es)?")
COOLED = re.compile(r"LR ×([\d.e+-]+) for ([\d,]+) steps?")
CONTRADICTIONS = [
    (re.compile(r"grad(?:ient)? norm was normal", re.I), re.compile(r"grad(?:ient)? norm exploded first", re.I)),
]


SPECIAL = {"NaN": math.nan, "Inf": math.inf, "-Inf": -math.inf}


def _num(text: str) -> float:
    return SPECIAL[text] if text in SPECIAL else float(text.replace(",", ""))


def _same(said: str, stored: Optional[float]) -> bool:
    if stored is None:
        return False
    if fmt(stored) == said:
        return True
    x = _num(said)
    if math.isnan(x) or math.isnan(stored):
        return math.isnan(x) and math.isnan(stored)
    return math.isfinite(x) and math.isfinite(stored) and abs(x - stored) <= 5e-4 * max(abs(stored), 1e-30)


class RunData:
    """The stored facts of one run, read through the API and cached."""

    def __init__(self, get: Get, run_id: int):
        self.get, self.run_id = get, run_id
        self.events = get(f"/api/v1/runs/{run_id}/events")["events"]
        setups = [e["data"] for e in self.events if e["kind"] == "run_setup"]
        self.setup = setups[-1] if setups else {}
        self._cache: dict[tuple[str, int, int], list] = {}
        self._rewinds: Optional[list[dict]] = None

    def rewinds(self) -> list[dict]:
        """The run's rewinds as ``/rewinds`` lists them (the agent's Rewind policy)."""
        if self._rewinds is None:
            self._rewinds = self.get(f"/api/v1/runs/{self.run_id}/rewinds")["rewinds"]
        return self._rewinds

    def points(self, signal: str, start: int, end: int, rank: int = 0) -> list[dict]:
        key = (signal, start, end, rank)
        if key not in self._cache:
            try:
                body = self.get(f"/api/v1/runs/{self.run_id}/series?signal={signal}&start={start}&end={end}"
                                f"&max_points={max(1, end - start + 1)}&rank={rank}")
                self._cache[key] = [p for p in body["steps"] if p["count"] or p["nonfinite"]]
            except (KeyError, TypeError):
                self._cache[key] = []
        return self._cache[key]

    def at(self, signal: str, step: int, rank: int = 0) -> Optional[float]:
        """The stored value at ``step`` (NaN for a non-finite one), None when none is stored."""
        pts = [p for p in self.points(signal, step, step, rank) if p["step"] == step]
        if not pts:
            return None
        v = pts[0]["last"]
        if isinstance(v, str):
            return _num(v)
        return math.nan if v is None else float(v)

    def last_before(self, signal: str, step: int, rank: int = 0, back: int = 200) -> Optional[float]:
        """The last value stored before ``step`` (NaN for a non-finite one)."""
        pts = self.points(signal, max(0, step - back), step - 1, rank)
        if not pts:
            return None
        v = pts[-1]["last"]
        return _num(v) if isinstance(v, str) else (math.nan if v is None else float(v))

    def clips(self, step: int, rank: int = 0) -> Optional[float]:
        """The max_norm the run clips to at ``step`` (None: it does not clip, as far as is stored)."""
        v = self.at("clip_max_norm", step, rank)
        if v is not None and math.isfinite(v):
            return v
        clip = (self.setup or {}).get("clip") or {}
        return clip.get("max_norm")

    def has_ema(self) -> bool:
        return bool((self.setup or {}).get("ema"))

    def all_skipped(self, first: int, last: int, rank: int = 0) -> bool:
        pts = self.points("overflow", first, last, rank)
        return bool(pts) and all(p["min"] == 1.0 for p in pts)


def texts(alert: dict) -> list[tuple[str, str]]:
    return [("message", alert["message"] or ""), ("diagnosis", alert["diagnosis"] or "")] + \
        [(f"action {i + 1}", a) for i, a in enumerate(alert.get("actions") or [])]


def check_alert(run: RunData, alert: dict, others: list[dict]) -> list[str]:
    rank = max(alert["rank"], 0)
    who = f"alert {alert['id']} {alert['rule']} (steps {alert['first_step']}-{alert['last_step']})"
    out: list[str] = []
    # 1. numbers tied to a step
    for where, text in texts(alert):
        for pattern, signal in STEP_CLAIMS:
            for m in pattern.finditer(text):
                said, step = m.group(1), int(m.group(2).replace(",", ""))
                stored = run.at(signal, step, rank)
                if not _same(said, stored):
                    out.append(f"{who}: its {where} says {signal} {said} at step {step}; stored: {fmt(stored)}")
        for pattern, signal in NOW_CLAIMS:
            for m in pattern.finditer(text):
                stored = run.at(signal, alert["last_step"], rank)
                if not _same(m.group(1), stored):
                    out.append(f"{who}: its {where} says {signal} is now {m.group(1)}; at its last step "
                               f"{alert['last_step']} it is {fmt(stored)}")
        m = re.search(rf"(?:last grad norm |grad norm was normal \(last ){NUM}", text)
        if m:
            stored = run.last_before("grad_norm", alert["first_step"], rank)
            if not _same(m.group(1), stored):
                out.append(f"{who}: its {where} says the last grad norm before step {alert['first_step']} was "
                           f"{m.group(1)}; stored: {fmt(stored)}")
    ev = alert.get("evidence") or {}
    for key in ("loss", "grad_norm", "loss_scale"):
        for part, step in ((ev, alert["first_step"]), (ev.get("last") or {}, alert["last_step"])):
            said = part.get(key) if isinstance(part, dict) else None
            if said is None or isinstance(said, (dict, list)) or "ranks" in ev:
                continue
            said_f = _num(said) if isinstance(said, str) else float(said)
            stored = run.at(key, step, rank)
            if stored is not None and not _same(fmt(said_f), stored):
                out.append(f"{who}: evidence{'.last' if part is not ev else ''}.{key} = {said} at step {step}; "
                           f"stored: {fmt(stored)}")
    # 2. contradictions on one alert
    whole = "\n".join(t for _, t in texts(alert))
    for a, b in CONTRADICTIONS:
        if a.search(whole) and b.search(whole):
            out.append(f"{who}: says both '{a.search(whole).group(0)}' and '{b.search(whole).group(0)}'")
    # 3. advice the run already follows
    max_norm = run.clips(alert["first_step"], rank)
    for where, text in texts(alert):
        if max_norm is not None and CLIP_ADVICE.search(text):
            out.append(f"{who}: its {where} asks to enable clipping; the run clips at max_norm={max_norm:g}")
        # the checkpoint advice of server/forensics/rollback.py (evidence.rollback.action) restarts the run
        # before the incident (decided there); the rule's own texts are what is checked here
        if text == ((ev.get("rollback") or {}).get("action")):
            continue
        if ROLLBACK_ADVICE.search(text) and run.all_skipped(alert["first_step"], alert["last_step"], rank):
            out.append(f"{who}: its {where} advises a rollback / skipping the batch; the loss scaler skipped "
                       f"every step of it, the weights never took those updates")
        if run.has_ema() and EMA_ADVICE.search(text):
            out.append(f"{who}: its {where} asks for an EMA; the run has one")
    # 4. what deviated first vs the timeline
    deviated = (alert["diagnosis"] or "").split(DEVIATED, 1)
    if len(deviated) == 2:
        sentence = deviated[1]
        m = NOTHING_DRIFTED.search(sentence)
        if m:
            n = int(m.group(1).replace(",", ""))
            earlier = [o for o in others if o["id"] != alert["id"] and o["severity"] in ("warning", "critical")
                       and alert["first_step"] - n <= o["first_step"] < alert["first_step"]]
            if earlier:
                o = earlier[0]
                out.append(f"{who}: says nothing drifted in the {n} steps before step {alert['first_step']}; the "
                           f"run's {o['severity']} {o['rule']} {o['name']} started at step {o['first_step']}")
        if FROM_STEP.search(sentence):
            incident = run.get(f"/api/v1/alerts/{alert['id']}/incident")
            onsets = {t["step"] for t in incident["timeline"] if t["kind"] == "precursor"}
            for m in FROM_STEP.finditer(sentence):
                s = int(m.group(1).replace(",", ""))
                if s not in onsets:
                    out.append(f"{who}: 'what deviated first' names step {s}; the incident timeline has no "
                               f"precursor there ({sorted(onsets)})")
    out += _check_rewinds(run, alert, who)
    return out


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _check_rewinds(run: RunData, alert: dict, who: str) -> list[str]:
    out = []
    mine = [r for r in run.rewinds() if (r.get("trigger") or {}).get("alert_id") == alert["id"]]
    said = [(_int(m.group(1)), m.group(2)) for a in alert.get("actions") or ()
            if isinstance(a, str) and (m := ACTED_ON.match(a))]
    for step, words in said:
        match = [r for r in mine if r["step"] == step]
        if not match:
            out.append(f"{who}: says the Rewind policy acted on it at step {step}; no rewind of this alert is "
                       f"stored there ({[r['step'] for r in mine]})")
            continue
        r = match[0]
        m = REWOUND.search(words)
        if m and (r["action"] != "rewind" or _int(m.group(1)) != r["to_step"] or _int(m.group(2)) !=
                  r["batches_skipped"] or r["batches_skipped"] != r["from_step"] - r["to_step"]):
            out.append(f"{who}: says '{m.group(0)}' at step {step}; stored: {r['action']} to step {r['to_step']}, "
                       f"{r['batches_skipped']} batches skipped, from step {r['from_step']}")
        m = COOLED.search(words)
        if m and (float(m.group(1)) != r["lr_factor"] or _int(m.group(2)) != r["cool_steps"]):
            out.append(f"{who}: says '{m.group(0)}' at step {step}; stored: LR ×{r['lr_factor']:g} for "
                       f"{r['cool_steps']} steps")
    if mine and max(r["step"] for r in mine) not in {s for s, _ in said}:
        out.append(f"{who}: the Rewind policy acted on it at step {max(r['step'] for r in mine)}; the alert does "
                   f"not say so")
    return out


def check_run(get: Get, run_id: int) -> list[str]:
    """Every lie the run's alerts tell (empty: all true)."""
    run = RunData(get, run_id)
    alerts = get(f"/api/v1/alerts?run={run_id}")["alerts"]
    problems: list[str] = []
    for a in alerts:
        problems += check_alert(run, a, alerts)
    return problems


def api_getter(base: str) -> Get:
    from tests.conftest import http_json

    def get(path: str):
        status, body = http_json("GET", base + path, timeout=30)
        assert status == 200, (path, status, body)
        return body
    return get
