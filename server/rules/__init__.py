"""Rule catalogue and engine (see docs/rules.md)."""
