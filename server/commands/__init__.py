"""What the CLI's own subcommands run (``gradwatch demo``, ``export``, ``sync``) and the helpers they share:
child processes, one JSON request to a server, which extra a command needs."""
