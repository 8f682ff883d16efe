"""One JSON request to a gradwatch server from the CLI (``export --server``, ``import --server``),
with the errors a user can fix said in one line: refused (401/403: the token), any other HTTP
status with the server's ``detail``, and no answer at all. Standard library only: these commands
run where the server's packages may not be installed."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional


def request_json(req: urllib.request.Request, *, base: str, path: str, timeout: float, error: type[Exception],
                 token_of: str, data: Optional[bytes] = None) -> Any:
    """The decoded JSON answer to ``req``; ``error(message)`` raised for what goes wrong.

    ``token_of`` completes "pass --token or set GRADWATCH_TOKEN to a token of …".
    """
    try:
        with urllib.request.urlopen(req, data=data, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("detail", detail)
        except (ValueError, AttributeError):
            pass
        if e.code in (401, 403):
            raise error(f"the server refused the request ({e.code}: {detail}); pass --token or set "
                        f"GRADWATCH_TOKEN to a token of {token_of}") from None
        raise error(f"{base}{path}: HTTP {e.code}: {detail}") from None
    except OSError as e:
        reason = getattr(e, "reason", None) or e
        raise error(f"cannot reach the server at {base} ({reason}); is `gradwatch serve` running?") from None
