"""Running the server: its settings, the configuration files it rereads, its Prometheus counters, the
port probe."""
