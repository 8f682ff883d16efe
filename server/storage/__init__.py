"""Storage: the schema (ORM models), engines and migrations' runner, projects by name, and the rollups
ingest writes and the reads use."""
