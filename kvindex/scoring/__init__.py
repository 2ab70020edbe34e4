"""Ranking instances for a request from index matches and instance load."""

from kvindex.scoring.overlap import COST_UNIT, OverlapCost, Ranked

__all__ = ["COST_UNIT", "OverlapCost", "Ranked"]
