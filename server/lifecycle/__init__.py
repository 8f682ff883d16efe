"""Data lifecycle of a long-lived team server: delete, size, back up and retain runs.

- ``delete``: delete a run, a set of runs or a project in bounded batches, with a
  tombstone (table ``deleted_runs``, migration 0011) so a deleted run's late batches are
  rejected instead of resurrecting half a run.
- ``sizes``: bytes per run (an estimate) and the total database size.
- ``backup``: online backup of a SQLite database (``gradwatch backup``); PostgreSQL uses
  pg_dump/pg_restore (docs/deployment.md, "Backup and restore").
- ``retention`` (part B): retention policy and compaction; its migration 0012 chains
  onto 0011.
"""
