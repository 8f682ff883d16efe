"""Webhook delivery worker. PLACEHOLDER until the webhooks work lands."""
from __future__ import annotations


class DeliveryWorker:
    def __init__(self, sessionmaker, settings):
        self.sessionmaker = sessionmaker
        self.settings = settings

    async def start(self) -> None:
        pass

    def wake(self) -> None:
        pass

    async def stop(self) -> None:
        pass
