"""What zerofn holds and moves, per rank: model-state bytes by role and device, and the
elements each kind of collective carried in the last optimizer step. The runtime
measures both (runtime/memory.py, runtime/comm.py)."""
from __future__ import annotations

from torch import nn

from ..runtime.attach import runtime_of


def model_state_bytes(model: nn.Module) -> dict[str, dict[str, int]]:
    """``{where: {"params", "grads", "optimizer", "buffers"}}`` bytes held on this rank.

    ``where`` is the compute device's type ("cuda", "cpu"), "host" for what ``offload``
    keeps in host memory (for NVMe: its staging buffers), "nvme" for its swap file (its
    parameter shards under ``params=True`` count as ``params``).

    ``params`` are the compute parameters (full for ZeRO-1/2, shards for ZeRO-3),
    ``grads`` the gradients held (full for ZeRO-1, reduced shards for ZeRO-2/3),
    ``optimizer`` the optimizer state plus master parameters where they are not the compute
    parameters (mixed precision), ``buffers`` zerofn's reusable communication and gather
    buffers (not model state; bounded by configuration).
    """
    return runtime_of(model).model_state_bytes()


def comm_stats(model: nn.Module) -> dict[str, int]:
    """Elements (and ``*_bytes``) per collective kind in the last finished optimizer step.

    Unprefixed keys count the shard dimension (every rank without HSDP); under HSDP the
    replicate dimension's own collectives follow as ``replicate.<kind>`` keys (the
    averaging all-reduce of the reduced shards, the loss-scaling overflow vote); with
    ``groups=``, each pattern's own group's as ``<pattern>.<kind>`` keys (the experts'
    gathers and reductions).

    Returns:
        ``{kind: elements, kind + "_bytes": bytes}``, elements of full (gathered or
        pre-scatter) buffers, as docs/design.md's traffic formulas count them.

    Example:
        >>> stats = zf.comm_stats(model)
        >>> stats["reduce_scatter_bytes"], stats.get("replicate.all_reduce_bytes", 0)
    """
    return dict(runtime_of(model).comm_stats())
