"""``python -m gradwatch.server …`` is the ``gradwatch`` console script."""
from gradwatch.server.cli import main

raise SystemExit(main())
