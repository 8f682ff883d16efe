"""The write path: a batch from an agent into storage (``write.ingest_batch``), with what it needs on the
way: ranks combined, a resumed run's numbering, the reply's pace, the write gate, the live push."""
