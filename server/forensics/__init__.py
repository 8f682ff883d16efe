"""Forensics over a run's stored history: what deviated before a critical alert (precursors.py), what to do
about an incident (rollback.py: the checkpoint to roll back to, the batches to skip), and the one read an
incident page needs (incident.py). Reads the stored history; called by ingest and the dashboard."""
