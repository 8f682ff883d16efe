"""The default port and the one bind probe used before starting a server (standard library only).

``gradwatch serve`` and ``gradwatch demo`` ask the same question before they start a server: can
``host:port`` be bound *as uvicorn will bind it*? uvicorn sets ``SO_REUSEADDR``, so a port whose
last server has just exited (its connections in TIME_WAIT) is free for it; a probe without that
flag would call it busy, and a demo re-run right after the previous one would refuse to start.
"""
from __future__ import annotations

import socket
from typing import Optional

DEFAULT_PORT = 8470


def port_problem(host: str, port: int) -> Optional[str]:
    """Why ``host:port`` cannot be bound right now (None when it can; port 0 always can)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"unknown host: {e}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None
