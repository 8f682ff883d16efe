"""What a compacted run keeps of what retention took: ``runs.config["_retention"]``, read by the reads
(queries), ingest and the retention job alike (server/lifecycle/retention.py writes it).

Leaf module (standard library only): a storage fact, so the read path does not import the lifecycle room.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# the rollup levels a retained run may keep from (server/storage/models.py ROLLUP_LEVELS; repeated here so this
# module stays a leaf: tests/lifecycle/test_retention.py checks they agree)
LEVELS = (16, 256, 4096)
# where a compacted run records what it lost: runs.config[RECORD_KEY] (JSON, no migration, like
# runs.config["_step_shift"] in server/ingest/resume.py)
RECORD_KEY = "_retention"


def raw_floor(config: Optional[dict]) -> int:
    """The step below which a run's raw rows were compacted (0: none), read cheaply on every batch.

    >>> raw_floor({"_retention": {"raw_before": 4096}}), raw_floor({}), raw_floor(None)
    (4096, 0, 0)
    """
    rec = config.get(RECORD_KEY) if isinstance(config, dict) else None
    return int(rec.get("raw_before") or 0) if isinstance(rec, dict) else 0


@dataclass(frozen=True)
class CompactionRecord:
    """What retention took from a run (``runs.config["_retention"]``): its raw rows of steps below
    ``raw_before`` (every rank), the rollup levels below ``step_level`` / ``layer_level`` there, and in a
    sharded run the ranks' own per-layer rows below ``rank_layers_before`` (combined steps only).
    ``first`` / ``last``: per rank, the first step the run had and the last one compacted, so a chart
    still spans the whole run."""

    raw_before: int = 0
    step_level: int = 16
    layer_level: int = 4096
    rank_layers_before: int = 0
    first: dict[int, int] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Optional[dict]) -> Optional["CompactionRecord"]:
        rec = (config or {}).get(RECORD_KEY) if isinstance(config, dict) else None
        if not isinstance(rec, dict):
            return None
        return cls(raw_before=int(rec.get("raw_before", 0)), step_level=int(rec.get("step_level", 16)),
                   layer_level=int(rec.get("layer_level", 4096)),
                   rank_layers_before=int(rec.get("rank_layers_before", 0)),
                   first={int(k): int(v) for k, v in (rec.get("first") or {}).items()},
                   last={int(k): int(v) for k, v in (rec.get("last") or {}).items()})

    def as_json(self, **extra) -> dict:
        return {"raw_before": self.raw_before, "step_level": self.step_level, "layer_level": self.layer_level,
                "rank_layers_before": self.rank_layers_before, "first": {str(k): v for k, v in self.first.items()},
                "last": {str(k): v for k, v in self.last.items()}, **extra}

    def bounds(self, rank: int, lo: Optional[int], hi: Optional[int]) -> tuple[Optional[int], Optional[int]]:
        """A rank's step range widened over what was compacted (raw ``lo`` / ``hi`` may be None)."""
        first, last = self.first.get(rank), self.last.get(rank)
        if first is not None:
            lo = first if lo is None else min(lo, first)
        if last is not None:
            hi = last if hi is None else max(hi, last)
        return lo, hi

    def step_level_for(self, start: int) -> int:
        """The finest rollup level a series starting at ``start`` may read (0: raw rows are all there)."""
        return self.step_level if start < self.raw_before else 0

    def layer_level_for(self, rank: int, start: int) -> int:
        """The same for per-layer statistics of ``rank`` (``rank_layers_before`` is set in sharded runs only)."""
        if start < self.raw_before:
            return self.layer_level
        if rank >= 0 and start < self.rank_layers_before:
            return LEVELS[0]
        return 0
