"""Ranking instances for a request: the TTFT cost model, calibration, routing state and policies."""

from kvindex.scoring.base import Candidate, Choice, RouteRequest
from kvindex.scoring.ranker import Ranker, RankerConfig, ScoreResult

__all__ = ["Candidate", "Choice", "Ranker", "RankerConfig", "RouteRequest", "ScoreResult"]
