"""Process lifecycle shared by every long-running entry point: signals, parent death, bounded
shutdown and closing NATS connections whatever state they are in (README.md)."""

from kvindex.lifecycle.bounded import bounded, finish
from kvindex.lifecycle.children import die_with_parent
from kvindex.lifecycle.nats_close import close_nats
from kvindex.lifecycle.run import Stop, run

__all__ = ["Stop", "bounded", "close_nats", "die_with_parent", "finish", "run"]
