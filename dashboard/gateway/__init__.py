"""The dashboard's one door to the data: ``server.queries`` for reads, the rules
and webhooks modules for the few writes a user makes (acknowledge an alert,
add / test / delete a webhook endpoint, override a rule threshold).

Nothing in ``dashboard/`` opens a session or touches SQL anywhere else. Each
function opens one short session, calls one server function and returns plain
dicts and lists, so page callbacks never hold ORM objects past a session.

The door is split by resource, one module each (context.py holds what they share: what the server
handed over, the signed-in project, the session); pages call the functions by this package's names
(``gateway.list_runs``), so a page never learns which module holds one.
"""
from gradwatch.dashboard.gateway.context import (SCOPE_KEY, configure, signed_in_project, stall_seconds)  # noqa: F401
from gradwatch.dashboard.gateway.runs import (list_runs, get_run, steps_after, wait_for_steps, get_series,  # noqa: F401
                                              get_rank_meta, get_rank_matrix, get_layer_matrix)
from gradwatch.dashboard.gateway.alerts import (list_alerts, recoveries, early_warnings, get_incident,  # noqa: F401
                                                acknowledge_alert)
from gradwatch.dashboard.gateway.events import list_events, list_checkpoints, list_rewinds  # noqa: F401
from gradwatch.dashboard.gateway.webhooks import (list_endpoints, create_endpoint, delete_endpoint, send_test,  # noqa: F401
                                                  list_deliveries)
from gradwatch.dashboard.gateway.rules import (rule_text, setup_rule_ids, cross_rank_rule_ids, get_rule_config,  # noqa: F401
                                               set_rule_override)
from gradwatch.dashboard.gateway.silences import list_silences, create_silence, expire_silence  # noqa: F401
from gradwatch.dashboard.gateway.lifecycle import (delete_preview, delete_run, format_bytes, database_size)  # noqa: F401
