"""The pace's bounds: numbers of the ingest reply's ``pace`` that the agent and the server share.

The server computes each rank's pace (server/ingest/pacing.py) within these bounds, and the agent obeys a pace
up to ``MAX_PACE_S`` and guesses one before the first reply (agent/pacing.py). A leaf with no imports,
so that the server reads them without importing the agent's sending code (docs/architecture.md: the
server depends on the agent only through the torch-free table, the wire format and small shared modules
like this one).
"""
from __future__ import annotations

# the most batches a second one run's ranks are asked to send together, and the longest pace asked
# (server/ingest/pacing.py computes the pace; these bounds are shared so a rank's guess before the first
# reply is the least pace the server can ask, and the agent obeys up to MAX_PACE_S: agent/sender.py).
# 10 s, not less: a server whose batches are dear (a slow machine, 256 sharded ranks: ~20 ms a batch)
# needs it to keep its lock half free; at 5 s it fell behind by seconds, every batch queued
# (docs/performance.md, "One run of many ranks"). Longer would hold back the combined rows and the
# cross-rank rules (judged once a step's last rank has sent it) for more than a few steps.
RUN_BATCHES_PER_S = 128.0
MAX_PACE_S = 10.0
# how much dearer than the least a rank assumes the server's batches before it has heard (initial_pace);
# the server asks a young run's ranks for at least that pace too
FIRST_HOLD_FACTOR = 4.0
