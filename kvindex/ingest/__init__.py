"""Ingestion: wire bytes -> sequencer -> index (consumer), and the NATS subscription feeding it."""

from kvindex.ingest.consumer import Consumer
from kvindex.ingest.nats_source import NatsSource

__all__ = ["Consumer", "NatsSource"]
