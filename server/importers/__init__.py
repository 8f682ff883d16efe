"""``gradwatch import``: existing runs from other loggers turned into gradwatch runs."""
