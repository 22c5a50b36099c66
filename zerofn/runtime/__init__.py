"""What a plan becomes: unit layout, collectives, hooks and the sharded optimizer.

Its face: ``runtime_of(model)`` finds a model's runtime as a ``RuntimeView`` (view.py),
the members the rest of zerofn may use; ``StepObserver`` and ``ObserverKind`` are what
observers from outside implement (events.py). Nothing here imports anything of zerofn's
outside this folder but the plan and the optimizer kernels."""
from .attach import is_transformed, runtime_of
from .events import ObserverKind, StepObserver
from .host_malloc import return_large_frees
from .owned import whole_tensors
from .process_exit import finish_collectives_at_exit
from .runtime import apply_plan, chained
from .step_grads import NonFiniteGradient
from .view import RuntimeView

__all__ = ["NonFiniteGradient", "ObserverKind", "RuntimeView", "StepObserver", "apply_plan", "chained",
           "finish_collectives_at_exit", "is_transformed", "return_large_frees", "runtime_of",
           "whole_tensors"]
