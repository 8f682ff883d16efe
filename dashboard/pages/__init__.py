"""One module per dashboard page: ``dash.register_page`` + layout + its callbacks.

A page is a plug-in like a collector or a rule (docs/architecture.md, "One way to register a plug-in"):
a module of this package, imported by :func:`page_modules`' list, that declares itself when imported
(``dash.register_page(__name__, path=..., name=..., order=...)``). No list names the pages: a new
page is a new file here. ``order`` places it (Dash sorts its page registry by it); a page with a fixed
``path`` (not a ``path_template``) is a link in the header's navigation, labelled by its ``name``.
"""
from __future__ import annotations


def page_modules() -> tuple[str, ...]:
    """The page modules' full names, in module-name order (modules named ``_…`` are helpers, not pages)."""
    import pkgutil

    return tuple(f"{__name__}.{info.name}" for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)
                 if not info.name.startswith("_"))
