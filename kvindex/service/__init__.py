"""Assembling and running the service (and the embedded nats-server)."""
