"""Alert routing between the rule engine and the outbox: grouping, inhibition, silences, routes, receivers.

Imports point one way: ``rules`` (alerts, config) ← ``routing`` → ``webhooks`` (outbox, formats). The
engine hands its alerts to ``routing.dispatch.route_alerts`` at the seam where ingest used to call the
outbox directly. Kept empty so ``routing.cli`` loads with the standard library only.
"""
