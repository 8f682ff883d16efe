"""``python -m gradwatch.server …`` is the ``gradwatch`` console script."""
from .cli import main

raise SystemExit(main())
