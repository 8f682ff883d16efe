"""Interval-driven callbacks that never starve.

A Dash callback fired by a ``dcc.Interval`` whose response takes longer than
the interval is fired again before it answers, and the renderer drops the
older answer each time: a page on a slow or busy server never updates at all
(plotly/dash#1613). Every polling callback in the dashboard therefore pauses
its own interval while it runs, so a tick starts only after the previous one
was applied: the page updates as often as the server can answer, at most once
per interval.
"""
from __future__ import annotations

from dash import Output


def pause_while_running(interval_id: str) -> list:
    """The ``running=`` argument of a callback polled by ``interval_id``."""
    return [(Output(interval_id, "disabled"), True, False)]
