"""Collectors: small pieces that read one kind of signal from torch objects without syncing."""
