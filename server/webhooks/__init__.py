"""Webhook outbox, delivery worker, payload formats and signing."""
