"""Ordering of each instance's batches: duplicates, gaps, restarts (epochs)."""

from kvindex.sequencer.cursor import Admission, Cursor, Sequencer, Verdict

__all__ = ["Admission", "Cursor", "Sequencer", "Verdict"]
