"""Dash dashboard. PLACEHOLDER until the dashboard work lands."""
from __future__ import annotations


def create_dash(sessionmaker, settings):
    import dash
    from dash import html

    app = dash.Dash(__name__, requests_pathname_prefix="/", routes_pathname_prefix="/")
    app.layout = html.Div("gradwatch")
    return app
