"""Ordering of each instance's batches: duplicates, gaps, restarts (epochs), the repair buffer."""

from kvindex.sequencer.cursor import Cursor, Sequencer, Verdict, decide

__all__ = ["Cursor", "Sequencer", "Verdict", "decide"]
