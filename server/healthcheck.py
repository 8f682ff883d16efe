"""``python -m gradwatch.server.healthcheck [--url URL]``: exit 0 when the API *and* the dashboard answer.

Entry module (the image's HEALTHCHECK and the compose file's health checks run it); the probe is
server/operations/healthcheck.py, standard library only, which ``gradwatch demo`` also calls.
"""
from gradwatch.server.operations.healthcheck import main

if __name__ == "__main__":
    raise SystemExit(main())
