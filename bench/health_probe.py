"""Polls a server's ``/api/health`` until told to stop; each answer's time and the failures.

bench/abuse.py runs it in a process of its own (as a load balancer's or an orchestrator's probe would be)
or, with ``--probe-in-process``, in a thread of its own process. It imports nothing beyond the standard
library, so that its process polls within milliseconds of its start.

    python bench/health_probe.py PORT EVERY_S     # until stdin is closed; then prints {"times": [...], "failures": N}
"""
from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def poll_health(port: int, every_s: float, stop: threading.Event) -> tuple[list[float], int]:
    """GET /api/health every ``every_s`` until ``stop`` is set: each answer's seconds, and the polls that failed
    (a status other than 200, or no answer)."""
    times, failures = [], 0
    while not stop.is_set():
        t = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("GET", "/api/health")
            resp = conn.getresponse()
            resp.read()
            conn.close()
            failures += resp.status != 200
        except OSError:
            failures += 1
        times.append(time.perf_counter() - t)
        stop.wait(every_s)
    return times, failures


def main() -> None:
    port, every_s = int(sys.argv[1]), float(sys.argv[2])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()   # stdin closed: stop
    times, failures = poll_health(port, every_s, stop)
    print(json.dumps({"times": times, "failures": failures}))


if __name__ == "__main__":
    main()
