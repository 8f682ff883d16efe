"""The run page's panels, heatmaps and compare charts as the signal table declares them: which lines,
dashed reference lines and flags each panel draws, in which colour."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from gradwatch.agent import signals as table
from gradwatch.dashboard import theme


@dataclass(frozen=True)
class Line:
    """One signal drawn as a line."""
    signal: str
    name: str
    colour: str
    dash: Optional[str] = None
    scale: float = 1.0  # e.g. bytes -> GiB


@dataclass(frozen=True)
class Flag:
    """Steps where a boolean signal is true, drawn as markers on ``host`` (the line's signal)."""
    signal: str
    name: str
    host: str
    symbol: str = "triangle-down"
    colour: str = theme.FLAG_COLOUR


@dataclass(frozen=True)
class Panel:
    """A run-page chart: its lines, optional smoothed copy of the first line, flags and NaN rug."""
    key: str
    title: str
    lines: tuple[Line, ...]
    log_y: bool = False
    smoothed: bool = False
    flags: tuple[Flag, ...] = ()
    y_title: str = ""
    include_zero: bool = False  # absolute quantities: a constant LR reads as a level, not as noise

    @property
    def signals(self) -> tuple[str, ...]:
        out = [ln.signal for ln in self.lines] + [f.signal for f in self.flags]
        return tuple(dict.fromkeys(out))

    def trace_names(self) -> list[str]:
        """Trace order is fixed: lines, smoothed line, flags, NaN rug (live appends address them by index)."""
        names = [ln.name for ln in self.lines]
        if self.smoothed:
            names.append(f"{self.lines[0].name} (smoothed)")
        names += [f.name for f in self.flags]
        names.append("NaN / Inf")
        return names


def _panel(p: table.Panel) -> Panel:
    """A run-page panel from the signal table: its signals drawn as lines (one palette colour each, in
    id order across the page), dashed reference lines and flags on the panel's first line."""
    decl = table.panel_signals(p.key)
    host = next(s.name for s in decl if s.draw == "line")
    lines, flags = [], []
    for s in decl:
        if s.draw == "flag":
            flags.append(Flag(s.name, s.label, host, symbol=s.marker))
        elif s.draw == "dash":
            lines.append(Line(s.name, s.label, theme.MUTED, dash="dash", scale=s.scale))
        else:
            lines.append(Line(s.name, s.label, theme.PALETTE[_LINE_COLOURS[s.name] % len(theme.PALETTE)],
                              scale=s.scale))
    return Panel(p.key, p.title, tuple(lines), log_y=p.log_y, smoothed=p.smoothed, flags=tuple(flags),
                 include_zero=p.include_zero)


# each drawn line keeps one colour on every page: its place among the table's line signals
_LINE_COLOURS = {s.name: i for i, s in enumerate(
    s for p in table.PANELS for s in table.panel_signals(p.key) if s.draw == "line")}
PANELS: tuple[Panel, ...] = tuple(_panel(p) for p in table.PANELS)
PANELS_BY_KEY = {p.key: p for p in PANELS}
HEADLINE: tuple[str, ...] = tuple(p.key for p in table.PANELS if p.headline)


def panel_signals(panels: Iterable[Panel]) -> tuple[str, ...]:
    """The signals some panels draw, each once, in panel order."""
    return tuple(dict.fromkeys(s for p in panels for s in p.signals))


SERIES_SIGNALS: tuple[str, ...] = panel_signals(PANELS)

# Per-layer heatmaps on the run page: (stat, title), the table's statistics that declare one.
HEATMAPS: tuple[tuple[str, str], ...] = tuple((s.name, s.heatmap) for s in table.LAYER_STATS if s.heatmap)


# The compare page: (signal, title, log y) for each step signal the table gives a compare title, in
# run-page panel order.
COMPARE_PANELS: tuple[tuple[str, str, bool], ...] = tuple(
    (s.name, s.compare, p.log_y) for p in table.PANELS for s in table.panel_signals(p.key) if s.compare)

# signals whose charts start at zero (their panel says include_zero)
ZERO_BASED = frozenset(s.name for s in table.STEP_SIGNALS if s.panel and table.panel(s.panel).include_zero)
