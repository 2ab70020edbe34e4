"""Ranking instances for a request: the TTFT cost model, calibration, routing state and policies."""

from kvindex.scoring.base import Candidate, Choice, RouteRequest
from kvindex.scoring.router import Router, RouterConfig, ScoreResult

__all__ = ["Candidate", "Choice", "RouteRequest", "Router", "RouterConfig", "ScoreResult"]
