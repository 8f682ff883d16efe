"""One module per dashboard page: ``dash.register_page`` + layout + its callbacks.

A page is a plug-in like a collector or a rule (docs/architecture.md, "One way to register a plug-in"):
a module of this package, imported by the one plug-in loader (``agent/plugins.py``'s ``modules``, from
``create_dash``), that declares itself when imported (``dash.register_page(__name__, path=..., name=...,
order=...)``; modules named ``_…`` are helpers, not pages). No list names the pages: a new page is a
new file here. ``order``, declared on the page, places it (Dash sorts its page registry by it, ties by
module name); a page with a fixed ``path`` (not a ``path_template``) is a link in the header's
navigation, labelled by its ``name``.
"""
