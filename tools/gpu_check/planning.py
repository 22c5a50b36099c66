"""The ``plan`` part: the planner's predictions for runs this GPU already recorded, with
this machine's own probe as the only input (nothing fitted to the records).

The records are the zerofn rows of the results file's ``largest`` part (the 7.06B run)
and ``compare`` part (1.31B): GPU peak (the allocator's), host RSS (VmHWM) and step time,
each predicted as the candidate bench_offload ran: ZeRO-3, bf16 compute, offload("cpu")
with fp32 masters and Adam state, one rank, its micro-batch, accumulation and activation
checkpointing."""
from __future__ import annotations

import json
import os
import sys

from .catalog import COMPARE_SIZE, LARGE_CPU, LIMIT
from .commands import run, tail
from .paths import TRACE_DIR

GIB = 2 ** 30
# (results part, size, micro-batches a step, activation checkpointing): as catalog's
# THROUGHPUT runs the 7.06B part and compare runs 1.31B (4 x 1024 tokens a micro-batch)
RECORDS = (("largest", LARGE_CPU, 32, True), ("compare", COMPARE_SIZE, 1, False))
BATCH, CONTEXT, VOCAB = 4, 1024, 50304
TARGETS = dict(gpu=0.05, host=0.05, step=0.15)    # the issue's: |error| at most


def part_plan(args) -> dict:
    probe = os.path.join(TRACE_DIR, "probe.json")
    rc, out = run([sys.executable, "-m", "zerofn", "probe", "--refresh", "--cache", probe],
                  LIMIT["plan"] * 0.7)
    if rc:
        return dict(status="failed", lines=["`zerofn probe` failed"], detail=tail(out))
    with open(args.results) as f:
        recorded = json.load(f).get("parts", {})
    lines, figures = [], {}
    for part, size, accum, checkpoint in RECORDS:
        got = measured(recorded.get(part, {}), size)
        if got is None:
            lines.append(f"{size}: no `{part}` record to predict")
            continue
        pred = predict(probe, size, accum, checkpoint)
        errors = {k: pred[k] / got[k] - 1 for k in got}
        figures[size] = dict(measured=got, predicted=pred, errors=errors)
        lines.append(f"{size}, {accum}x{BATCH}x{CONTEXT} tokens a step, checkpointing "
                     f"{'on' if checkpoint else 'off'}: " + "; ".join(
                         f"{k} predicted {_shown(k, pred[k])} against {_shown(k, got[k])} "
                         f"({100 * errors[k]:+.1f} %, target ±{100 * TARGETS[k]:.0f} %)"
                         for k in got))
    with open(probe) as f:
        m = json.load(f)
    figures["probe_seconds"] = m["seconds"]
    lines.append(f"inputs: this machine's probe ({m['seconds']:.0f} s): compute "
                 + ", ".join(f"{d} {w}: {r / 1e12:.0f} TFLOP/s"
                             for d, rates in m["process"].get("compute", {}).items()
                             for w, r in rates.items())
                 + f"; CPU Adam {m['cpu_adam_all'].get('fp32', 0) / 1e9:.2f} G params/s "
                 f"(every core); H2D {m['h2d'] / 1e9:.1f} GB/s, D2H {m['d2h'] / 1e9:.1f} GB/s")
    ok = any(isinstance(v, dict) for v in figures.values())
    return dict(status="ok" if ok else "failed", figures=figures, lines=lines)


def measured(record: dict, size: str) -> dict | None:
    """The record's zerofn row: GPU peak and host RSS (bytes), step time (s)."""
    for row in record.get("lines", []):
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 9 and cells[0].startswith(size) and cells[1] == "zerofn offload":
            try:
                return dict(gpu=float(cells[7]) * GIB, host=float(cells[8]) * GIB,
                            step=float(cells[4]) / 1e3)
            except ValueError:
                return None
    return None


def predict(probe: str, size: str, accum: int, checkpoint: bool) -> dict:
    import torch

    from zerofn.nanogpt import GPT, GPTConfig
    from zerofn.planner import Candidate, plan
    from zerofn.planner.probe import Machine
    width, layers = map(int, size.split("x"))
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, width=width, heads=width // 64, ffn=4 * width,
                              layers=layers, context=CONTEXT))
    x = torch.zeros(BATCH, CONTEXT, dtype=torch.long)
    with open(probe) as f:
        machine = Machine.from_json(json.load(f))
    c = Candidate(stage=3, precision="bf16", offload="cpu", checkpoint=checkpoint,
                  micro_batch=BATCH, accum=accum)
    row = plan(model, (x, x), world=1, batch=BATCH * accum, precision="bf16", only=[c],
               machine=machine, on_gpu=True, margin=0.0, saves=None).rows[0]
    return dict(gpu=row.peak["device"], host=row.peak["host"], step=row.seconds["total"])


def _shown(key: str, value: float) -> str:
    return f"{value:.3f} s" if key == "step" else f"{value / GIB:.2f} GiB"
