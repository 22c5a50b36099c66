"""The planner (issue 34): which ZeRO stage, offload, dtypes, checkpointing and micro-batch
to use, and whether they fit, predicted before anything is built. ``zf.plan`` lists the
candidates, ``zf.auto`` applies the choice, ``zerofn plan`` and ``zerofn probe`` are its
command lines (docs/plan.md)."""
from .candidates import Candidate
from .search import NoPlanFits, PlanResult, auto, plan

__all__ = ["Candidate", "NoPlanFits", "PlanResult", "auto", "plan"]
