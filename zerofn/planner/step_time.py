"""Seconds of one optimizer step for a candidate, from the same schedule the memory model
reads and the probe's rates (probe.py):

- **compute**: 6 flops per parameter per token (forward 2, backward 4), 8 with activation
  checkpointing (forward again), plus attention's score and value matmuls where the
  model says its context, at the rate the probe measured for a GPT's forward and backward
  in the compute dtype at the nearest width (log-interpolated between the two it ran),
  else its block matmul rate;
- **zerofn's own work** (packing, copies, hooks, the per-unit step, Python): per unit
  and per parameter for each stage, as the probe measured it at one rank on two
  calibration GPTs (many small units; few large ones);
- **collectives**: each one's bytes per rank over its probed bandwidth, plus the probed
  latency per call: DDP's all-reduce (2(n-1)/n of the gradients, at the all-reduce's bus
  bandwidth); zerofn's reduce-scatter and all-gather at their own (on gloo zerofn does
  them its own way, runtime/comm.py): ZeRO-1/2's reduce-scatter and the step's
  all-gather of the updated rows, ZeRO-3's forward and backward all-gathers (per
  micro-batch) and the reduce-scatter, (n-1)/n each; one call per unit;
- **the optimizer step**: torch's AdamW on the device touches 7 fp32 words per element
  (read parameter, gradient, two moments; write parameter and moments) at the probed
  memory bandwidth; zerofn's CPU Adam at the probed rate per state dtype; a whole-tensor
  optimizer's matmuls (Muon's Newton-Schulz, counted on its own step: owned.py) at the
  probed matmul rate of their dtype, the busiest owner's under ZeRO, all of them under
  DDP, and under ZeRO its traffic (docs/optimizers.md's: the gather to the owner and the
  update back, less the all-gather's share the broadcast replaces at ZeRO-1/2; the
  update back alone under ZeRO-3's ``reduce_to_owner``);
- **copies**: offload's gradients down and rows up (pinned H2D/D2H on a GPU, memory
  bandwidth on a CPU); NVMe's state read and written once per step at the probed disk
  rates;
- **shared cores**: ranks on a CPU that outnumber its cores share them (the probe records
  the count), so each term (compute, gloo's reductions, the step, the copies) takes that
  much longer;
- **overlap**, as zerofn has it: on a GPU collectives run on their own stream under
  compute (prefetch, the reduce stream) and the host step overlaps the next unit's
  copies; on a CPU with gloo, collectives and compute share the same cores, so the model
  adds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .candidates import DTYPES, Candidate
from .memory import FP32, Shape
from .owned import Owned
from .probe import Machine


@dataclass(frozen=True)
class Work:
    """What one step of the model does per rank, independent of the candidate."""

    tokens: int            # per rank per optimizer step
    attention_flops: int   # per token, forward (0 where unknown)
    width: int | None = None


def compute_rate(m: Machine, precision: str, width: int | None) -> float:
    """FLOP/s of forward and backward at ``width``: the probe's GPT rates, interpolated in
    log width between the two it ran (the nearer outside them); its matmul rate where it
    has none or the width is unknown."""
    rates = m.process.get("compute", {}).get(precision)
    if not rates or not width:
        return m.matmul.get(precision, m.matmul["fp32"])
    points = sorted((int(w), r) for w, r in rates.items())
    if width <= points[0][0]:
        return points[0][1]
    if width >= points[-1][0]:
        return points[-1][1]
    (w0, r0), (w1, r1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] <= width <= b[0])
    t = (math.log(width) - math.log(w0)) / (math.log(w1) - math.log(w0))
    return r0 + t * (r1 - r0)


def step_seconds(c: Candidate, shape: Shape, work: Work, m: Machine,
                 on_gpu: bool = False) -> dict[str, float]:
    """``{"compute", "comm", "step", "copies", "total"}`` seconds."""
    cb = DTYPES[c.precision].itemsize
    # a frozen parameter's backward makes its input's gradient, not its own: 4 flops
    frozen = shape.params - shape.trainable_params
    flops_per_token = (8 if c.checkpoint else 6) * shape.trainable_params \
        + (6 if c.checkpoint else 4) * frozen + (4 if c.checkpoint else 3) * work.attention_flops
    compute = flops_per_token * work.tokens / compute_rate(m, c.precision, work.width)
    if c.stage:
        compute += zerofn_work(m, c.stage, shape)
    comm = _comm(c, shape, m, cb)
    step = _step(c, shape, m, on_gpu)
    copies = _copies(c, shape, m, cb, on_gpu)
    if on_gpu:      # side streams: collectives under compute, copies under the host step
        return dict(compute=compute, comm=comm, step=step, copies=copies,
                    total=max(compute, comm) + max(step, copies))
    # On a CPU every term is the cores' work (gloo reduces on them too); ranks that
    # outnumber the cores share them, each term taking that much longer
    share = shape.world / m.cores if m.cores and shape.world > m.cores else 1.0
    out = dict(compute=compute * share, comm=comm * share, step=step * share,
               copies=copies * share)
    return dict(out, total=sum(out.values()))


def zerofn_work(m: Machine, stage: int, shape: Shape) -> float:
    """zerofn's own seconds a step at ``stage``: the probe's cost per unit and per
    parameter (an older probe's per parameter only)."""
    own = m.process.get("zerofn_own", {}).get(str(stage))
    if own is None:
        return m.process.get("zerofn_s_per_param", {}).get(str(stage), 0.0) * shape.params
    # (per parameter, frozen ones too: ZeRO-1/2's step gathers every unit's rows, and a
    # unit's reduction carries its frozen columns)
    return own["per_unit"] * len(shape.unit_shards) + own["per_param"] * shape.params


def _comm(c: Candidate, shape: Shape, m: Machine, cb: int) -> float:
    n = shape.world
    if n == 1:
        return 0.0
    latency, bw = m.collective(n)
    if c.stage == 0:     # DDP's buckets hold the gradients there are
        return 2 * (n - 1) / n * cb * shape.trainable_params / bw + c.accum * latency
    _, scatter = m.collective(n, "reduce_scatter")
    _, gather = m.collective(n, "all_gather")
    # the reduce-scatter of the units with gradients (their frozen columns too), once a
    # step under ZeRO-1 (no_sync before), each micro-batch under ZeRO-2/3; then ZeRO-1/2's
    # all-gather of every unit's updated rows (a frozen unit's too), ZeRO-3's of every
    # unit in forward and backward, each micro-batch
    scatters = 1 if c.stage == 1 else c.accum
    gathers = 1 if c.stage in (1, 2) else 2 * c.accum
    return (n - 1) * cb * (scatters * shape.reduced / scatter + gathers * shape.shard / gather) \
        + (scatters * len(shape.reduced_shards) + gathers * len(shape.unit_shards)) * latency \
        + _owned_comm(c, shape, cb, gather, latency)


def _owned_comm(c: Candidate, shape: Shape, cb: int, bw: float, latency: float) -> float:
    """The owned parameters' traffic over ZeRO's own (``owned_traffic``), each collective
    (n-1)/n of its buffer: two calls per parameter (the gather to its owner, the update
    back), or under ZeRO-3's ``reduce_to_owner`` the reduce each micro-batch and the
    scatter."""
    owned = shape.owned
    if owned is None:
        return 0.0
    n = shape.world
    calls = 1 + c.accum if c.to_owner and c.stage == 3 else 2
    return (n - 1) / n * owned_traffic(c, owned, cb) / bw + calls * len(owned.tensors) * latency


def owned_traffic(c: Candidate, owned: Owned, cb: int) -> int:
    """Bytes a step's collectives carry for the owned parameters over ZeRO's own for the
    same model under AdamW, each collective's full buffer as ``zf.comm_stats`` counts it
    (runtime/owned.py's [Note: owned traffic]; tests/test_owned_optimizers.py checks the
    runtime against the same): the gradient's gather to the owner (its padded rows, fp32)
    and at ZeRO-1/2 the owner's broadcast of the whole (fp32) in place of its aligned
    columns of the all-gather (compute dtype): +1x; at ZeRO-3 the gather and the scatter
    of the rows back: +2x; with ``reduce_to_owner`` the reduce to the owner (its padded
    rows) in place of its aligned columns of the reduce-scatter (both the compute dtype),
    and the scatter: +1x, and one more flag in the step's vote."""
    if c.stage == 0:
        return 0
    n = owned.world
    padded = sum(t.padded(n) for t in owned.tensors)
    columns = sum(t.columns(n) for t in owned.tensors)
    if c.stage in (1, 2):
        return FP32 * padded + FP32 * sum(t.numel for t in owned.tensors) - cb * columns
    if c.to_owner:
        return cb * padded - cb * columns + FP32 * padded + FP32
    return 2 * FP32 * padded


def _step(c: Candidate, shape: Shape, m: Machine, on_gpu: bool) -> float:
    elements = shape.adam_params if c.stage == 0 else shape.adam_local
    owned = _owned_step(c, shape, m)
    if c.offload is None:
        return 7 * 4 * elements / m.memory_bw + owned
    host = elements * c.ratio
    return host / host_adam_rate(m, c.state_dtype, shape.world, on_gpu) + \
        7 * 4 * elements * (1 - c.ratio) / m.memory_bw + owned


def _owned_step(c: Candidate, shape: Shape, m: Machine) -> float:
    """Seconds of a whole-tensor optimizer's matmuls on the busiest rank: every owned
    parameter's under DDP, the busiest owner's under ZeRO (the owners run at once)."""
    owned = shape.owned
    if owned is None:
        return 0.0
    ranks = [owned.flops_all] if c.stage == 0 else owned.flops
    return max(sum(f / m.matmul.get(d, m.matmul["fp32"]) for d, f in flops.items())
               for flops in ranks)


def host_adam_rate(m: Machine, state_dtype: str, world: int, on_gpu: bool) -> float:
    """Parameters per second zerofn's CPU Adam steps for one rank. On a CPU device each
    rank has one thread (the probe's rates are per thread, as the CPU grid runs). A GPU's
    rank has its machine's cores shared by the machine's ranks (``zerofn train`` gives each
    ``cores // ranks``): the one-thread rate times those threads, at most the rate the
    probe measured with every core."""
    one = m.cpu_adam.get(state_dtype, m.cpu_adam["fp32"])
    if not on_gpu or not m.cores:
        return one
    ranks = max(1, min(world, m.extra.get("gpus", world)))
    threads = max(1, m.cores // ranks)
    every = m.cpu_adam_all.get(state_dtype, m.cpu_adam_all.get("fp32", float("inf")))
    return min(one * threads, every)


def _copies(c: Candidate, shape: Shape, m: Machine, cb: int, on_gpu: bool) -> float:
    if c.offload is None:
        return 0.0
    moved = shape.trainable_local * c.ratio
    down, up = (m.d2h, m.h2d) if on_gpu and m.h2d else (m.memory_bw / 2, m.memory_bw / 2)
    seconds = cb * moved / down + cb * moved / up
    if c.offload == "nvme":
        stored = moved * (4 + 2 * 4)     # masters and two moments, read and written
        seconds += stored / m.disk_read + stored / m.disk_write
    return seconds
