"""The profile part: one offloaded step of a small GPT, in a worker process of its own
(CUDA and NCCL state start fresh): the host's synchronizations and waits, and from a
profiler trace how much of the copies' time other work covers."""
from __future__ import annotations

import json
import math
import os
import sys
import time

from .catalog import LIMIT
from .commands import run, tail
from .paths import PACKAGE, ROOT, TRACE_DIR

TRACE = os.path.join(TRACE_DIR, "profile_trace.json")


def part_profile(args) -> dict:
    rc, out = run([sys.executable, PACKAGE, "--worker", "profile", "--results", args.results],
                  LIMIT["profile"])
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if rc or line is None:
        return dict(status="failed", lines=["the profiled step did not finish"],
                    detail=tail(out, 30))
    runs = json.loads(line[len("RESULT "):])
    lines = []
    for r in runs:
        lines.append(f"{r['name']}: step {r['step_ms']:.0f} ms; host synchronizations in "
                     f"forward+backward {r['syncs_fwd_bwd']}, in the step {r['syncs_step']}; "
                     f"host waits on copy events in forward+backward "
                     f"{r['event_waits_fwd_bwd']}, in the step {r['event_waits_step']}; "
                     f"device-to-host copy time ({r['d2h_ms']:.1f} ms) overlapping "
                     f"compute kernels {100 * r['d2h_overlap_compute']:.0f} %, CPU Adam "
                     f"{100 * r['d2h_overlap_adam']:.0f} %, either "
                     f"{100 * r['d2h_overlap_either']:.0f} %; "
                     f"host-to-device copy time overlapping CPU Adam "
                     f"{100 * r['h2d_overlap_adam']:.0f} % ({r['h2d_ms']:.1f} ms)")
    lines.append(f"trace: `{os.path.relpath(TRACE, ROOT)}`")
    return dict(status="ok", figures={r["name"]: r for r in runs}, lines=lines)


def profile_worker(args) -> None:
    """Prints ``RESULT`` and the runs' figures as JSON, for part_profile to read."""
    import warnings

    import bench_offload as bo   # a sibling tool: tools/ is on sys.path wherever this is
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zerofn as zf
    from zerofn.nanogpt import GPT
    bo.init_world_1("cuda")
    bargs = bo.parse_args(["--device", "cuda", "--sizes", "1024x8"])
    cfg = bo.model_config("1024x8", bargs)
    runs = []
    for params in (False, True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                zf.mixed_precision(torch.bfloat16),
                                zf.offload("cpu", params=params))(model, opt)
        tokens = torch.randint(cfg.vocab, (4, bargs.batch, cfg.context + 1), device="cuda")

        def step(i, between=lambda: None):
            loss = model(tokens[i, :, :-1], tokens[i, :, 1:])
            loss.backward()
            between()
            opt.step()
            opt.zero_grad()

        step(0)
        step(1)
        torch.cuda.synchronize()
        counts = {}
        torch.cuda.set_sync_debug_mode("warn")
        # Sync-debug mode does not see an event's synchronize: count those host waits apart.
        waits, event_sync = [], torch.cuda.Event.synchronize
        torch.cuda.Event.synchronize = lambda e: waits.append(1) or event_sync(e)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(2, lambda: counts.update(fwd_bwd=len(caught), waits_fwd_bwd=len(waits)))
        torch.cuda.Event.synchronize = event_sync
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            step(3)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        name = f"1024x8 bf16 offload('cpu'{', params=True' if params else ''})"
        if not params:
            os.makedirs(TRACE_DIR, exist_ok=True)
            prof.export_chrome_trace(TRACE)
        runs.append(dict(name=name, step_ms=1e3 * seconds, syncs_fwd_bwd=counts["fwd_bwd"],
                         syncs_step=len(caught) - counts["fwd_bwd"],
                         event_waits_fwd_bwd=counts["waits_fwd_bwd"],
                         event_waits_step=len(waits) - counts["waits_fwd_bwd"],
                         **overlaps(prof.events())))
        del model, opt
    print("RESULT " + json.dumps(runs), flush=True)


def overlaps(events) -> dict:
    """From profiler events: total device-to-host and host-to-device copy time; the share
    of the first overlapping compute kernels, CPU Adam, and either (the host ring copies
    gradients down in the step, beside CPU Adam; landing buffers in backward, beside
    compute); and of the second overlapping CPU Adam."""
    def spans(pred):
        return [(e.time_range.start, e.time_range.end) for e in events if pred(e)]

    def is_gpu(e):
        return e.device_type.name == "CUDA"
    d2h = spans(lambda e: is_gpu(e) and "Memcpy DtoH" in e.name)
    h2d = spans(lambda e: is_gpu(e) and "Memcpy HtoD" in e.name)
    kernels = spans(lambda e: is_gpu(e) and "Memcpy" not in e.name and "Memset" not in e.name)
    adam = spans(lambda e: not is_gpu(e) and e.name.startswith("zerofn::cpu_adam"))
    return dict(d2h_ms=_total(d2h) / 1e3, h2d_ms=_total(h2d) / 1e3,
                d2h_overlap_compute=covered(d2h, kernels), d2h_overlap_adam=covered(d2h, adam),
                d2h_overlap_either=covered(d2h, kernels + adam),
                h2d_overlap_adam=covered(h2d, adam))


def _union(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _total(spans) -> float:
    return sum(e - s for s, e in _union(spans))


def covered(spans, by) -> float:
    """The share of the union of ``spans`` that the union of ``by`` covers."""
    total = _total(spans)
    if not total:
        return math.nan
    cover = _union(by)
    inside = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in _union(spans) for cs, ce in cover)
    return inside / total
