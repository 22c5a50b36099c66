"""What every hook of zerofn's has in common: it runs eagerly under torch.compile, it can
tell a recompute inside backward from a forward, and it can ask to hear when backward
reaches a forward's output."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

# [Note: hooks under torch.compile] zerofn's hooks run eagerly in a compiled model, as
# FSDP2's do (torch.compiler.disable): they gather, free and lend buffers, and record
# progress, Python state that dynamo cannot trace; the model's graphs break around them.
eager = torch.compiler.disable


def in_backward() -> bool:
    """Whether autograd is running backward on this thread (a checkpointed recompute)."""
    return torch._C._current_graph_task_id() != -1


def on_backward_begin(output, fn) -> None:
    """Call ``fn(grad)`` when backward reaches any tensor of ``output`` that needs a
    gradient (once per such tensor)."""
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(fn)
