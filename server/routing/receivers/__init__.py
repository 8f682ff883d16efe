"""Receivers that are not HTTP webhooks (email); the webhook ones live in ``server.webhooks``."""
