"""What a plan becomes: unit layout, collectives, hooks and the sharded optimizer.

Its face: ``runtime_of(model)`` finds a model's ``Runtime``, whose docstring lists what the
rest of zerofn may use; ``StepObserver`` and ``register`` let observers from outside
subscribe to its events (events.py). Nothing here imports anything of zerofn's outside
this folder but the plan and the optimizer kernels."""
from .attach import is_transformed, runtime_of
from .events import StepObserver, register
from .runtime import Runtime, apply_plan

__all__ = ["Runtime", "StepObserver", "apply_plan", "is_transformed", "register", "runtime_of"]
