"""Which project a caller may see: the one check the API routes and the dashboard's gateway make.

``scope`` is the project a request is limited to: the project of its token (API) or of the signed-in
session (dashboard); None when auth is off, where everything is visible. Leaf module.
"""
from __future__ import annotations

from typing import Optional


def in_scope(scope: Optional[str], project: Optional[str]) -> bool:
    """Whether a caller limited to ``scope`` may see ``project``'s data.

    >>> in_scope(None, "nlp"), in_scope("nlp", "nlp"), in_scope("nlp", "vision"), in_scope("nlp", None)
    (True, True, False, False)
    """
    return scope is None or project == scope


def other_project(scope: Optional[str], project: Optional[str]) -> str:
    """What a token of ``scope`` asking for ``project`` is told (HTTP 403)."""
    return f"this token is for project {scope!r}, not {project!r}"
