"""gradwatch server: ingest API, storage, rules, webhooks; mounts the dashboard (``gradwatch serve``)."""

# One module, one name: this folder is installed as gradwatch.server (pyproject.toml maps it at build
# time). Imported as a top-level `server` -- a checkout's root on sys.path -- every module
# would load a second time beside gradwatch.server's, with its own state; refuse instead.
if __name__ != "gradwatch.server":
    raise ImportError(f"{__path__[0]} is gradwatch's server package: import it as `gradwatch.server`, "
                      f"not as {__name__!r} (that name is left to your own code)")
