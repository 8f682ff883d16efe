"""Early-warning evaluation protocol (issue 41): generated divergent runs with healthy controls.

    .venv/bin/python -m bench.early_warning.sweep        # run the cases through the agent and a real server
    .venv/bin/python -m bench.early_warning.report       # the tables of docs/early-warning.md, both halves

See docs/early-warning.md ("Evaluation protocol") for the declared space, the divergence rule and the split.
"""
