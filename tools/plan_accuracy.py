"""The planner's predictions against measurement on this machine: per-rank peak memory
(peak RSS on a CPU, the allocator's peak on CUDA) and step time, over stages 0-3 × no
offload / CPU / NVMe × two GPT shapes × worlds 1, 2 and 4 (the grid), and the same for
model families outside it (tools/plan_models.py: a LoRA fine-tune, a tied GPT-2, a
convolutional net).

    python tools/plan_accuracy.py                       # the whole grid, a markdown table
    python tools/plan_accuracy.py --shapes wide --worlds 2 --stages 2 --offloads none
    python tools/plan_accuracy.py --shapes lora,tied,conv --worlds 1,2 --offloads none,cpu

Every configuration runs in a fresh set of processes (``torchrun``, one thread per rank):
glibc keeps freed heap, so a second configuration in the same process would start from a
high-water mark it did not cause. A rank's peak is its kernel high-water mark (VmHWM,
the whole process: what a budget has to hold), the configuration's the largest rank's;
its step time is the median of the timed steps, each the slowest rank's. The prediction
is ``zf.plan`` for that one candidate with this machine's probe (``zerofn probe``), made
before and apart from the run: nothing measured here feeds it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from plan_models import FAMILIES, trainable

from zerofn.runtime.host_malloc import THRESHOLD

OFFLOADS = {"none": None, "cpu": "cpu", "nvme": "nvme"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="narrow,wide",
                   help=f"models, of {', '.join(FAMILIES)} (tools/plan_models.py)")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--offloads", default="none,cpu,nvme")
    p.add_argument("--batch", type=int, default=2, help="sequences (images) per rank")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 untimed)")
    p.add_argument("--save", action="store_true",
                   help="also save a checkpoint after the timed steps (stages 1-3) and "
                        "measure the save's own peak against the plan's save phase")
    p.add_argument("--out", help="JSON lines of every measurement, appended as they come")
    p.add_argument("--from", dest="source",
                   help="predict again for the measurements in this JSON lines file "
                        "(from --out) instead of running them")
    p.add_argument("--probe", help="a `zerofn probe` JSON to predict with (default this "
                                   "machine's, probed once and cached)")
    p.add_argument("--malloc-threshold", type=int, default=THRESHOLD,
                   help="bytes: each rank calls zf.return_large_frees(this) first, the "
                        "planner's CPU premise (default 8 MiB); 0 leaves glibc's moving "
                        "threshold (tools/bench_malloc_threshold.py compares them)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def grid(args) -> list[tuple[str, int, int, str]]:
    out = []
    for shape in args.shapes.split(","):
        for world in map(int, args.worlds.split(",")):
            for stage in map(int, args.stages.split(",")):
                for off in args.offloads.split(","):
                    if stage == 0 and off != "none":
                        continue
                    out.append((shape, world, stage, off))
    return out


def candidate(stage: int, off: str, batch: int):
    from zerofn.planner import Candidate
    return Candidate(stage=stage, offload=OFFLOADS[off], micro_batch=batch)


def model_of(shape: str, device=None):
    import torch
    with torch.device(device or "cpu"):
        return FAMILIES[shape].build()


def predict(shape: str, world: int, stage: int, off: str, batch: int,
            probe: str | None = None) -> dict:
    """The plan's peak host bytes and step seconds for one configuration, and its save
    phase's host bytes under a synchronous save."""
    from zerofn.planner import plan
    from zerofn.planner.memory import PHASES, largest
    machine = machine_of(probe)
    model = model_of(shape, "meta")
    c = candidate(stage, off, batch)
    r = plan(model, FAMILIES[shape].inputs(batch, None), world=world, only=[c], on_gpu=False,
             machine=machine, saves="sync").rows[0]
    training = largest(r.phases, [ph for ph in PHASES if ph != "save"])   # (no save in it)
    return dict(peak=training["host"], step_s=r.seconds["total"],
                save_peak=r.phases["save"]["host"])


def machine_of(probe: str | None):
    """The probe's ``Machine``: from ``probe``'s JSON, else this machine's (cached)."""
    from zerofn.planner.probe import Machine, load_or_probe
    if not probe:
        return load_or_probe()
    with open(probe) as f:
        return Machine.from_json(json.load(f))


# -- worker: one configuration, under torchrun -------------------------------------------
def worker(spec: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from zerofn.runtime.memory import proc_bytes
    shape, world, stage, off, batch, steps, save, threshold = json.loads(spec)   # save: a dir
    torch.set_num_threads(1)
    if threshold:
        import zerofn as zf
        zf.return_large_frees(threshold)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = model_of(shape)
    opt = torch.optim.AdamW(trainable(model), lr=1e-4)
    with tempfile.TemporaryDirectory() as tmp:
        model, opt = candidate(stage, off, batch).apply(model, opt, nvme_path=tmp)
        inputs = FAMILIES[shape].inputs(batch, torch.Generator().manual_seed(rank))
        times = []
        for i in range(2 + steps):
            dist.barrier()
            t = time.perf_counter()
            model(*inputs).backward()
            opt.step()
            opt.zero_grad()
            if i >= 2:
                times.append(time.perf_counter() - t)
        mine = dict(peak=proc_bytes("VmHWM"), times=times)
        if save and stage:    # the save's own peak: the high-water mark reset to now
            import zerofn as zf
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            zf.save_checkpoint(save, model, opt, step=1)
            mine["save_peak"] = proc_bytes("VmHWM")
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            step = statistics.median(max(r["times"][i] for r in everyone)
                                     for i in range(steps))
            got = dict(peak=max(r["peak"] for r in everyone), step_s=step)
            if save and stage:
                got["save_peak"] = max(r["save_peak"] for r in everyone)
            print("RESULT " + json.dumps(got), flush=True)
        del model, opt
        gc.collect()
    dist.destroy_process_group()


def measure(shape, world, stage, off, args) -> dict:
    with tempfile.TemporaryDirectory() as shared:     # the ranks' one checkpoint root
        spec = json.dumps([shape, world, stage, off, args.batch, args.steps,
                           args.save and os.path.join(shared, "checkpoints"),
                           args.malloc_threshold])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), __file__, "--worker", spec]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"{shape} w{world} s{stage} {off} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def measurements(args):
    """(shape, world, stage, offload, measured) per configuration: run now (and appended
    to ``--out``), or read from ``--from``."""
    if args.source:
        with open(args.source) as f:
            for line in f:
                r = json.loads(line)
                yield r["shape"], r["world"], r["stage"], r["offload"], r["measured"]
        return
    for shape, world, stage, off in grid(args):
        got = measure(shape, world, stage, off, args)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(dict(shape=shape, world=world, stage=stage, offload=off,
                                        batch=args.batch, measured=got)) + "\n")
        yield shape, world, stage, off, got


def table(rows: list[dict]) -> str:
    out = ["| shape | world | stage | offload | peak measured MB | predicted MB | error |"
           " step measured s | predicted s | error |", "|---|---:|---:|---|---:|---:|---:|"
           "---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['world']} | {r['stage']} | {r['offload']} | "
                   f"{r['peak'] / 1e6:,.0f} | {r['pred_peak'] / 1e6:,.0f} | "
                   f"{100 * r['mem_err']:+.1f} % | {r['step_s']:.3f} | {r['pred_step_s']:.3f} |"
                   f" {100 * r['time_err']:+.1f} % |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    mem = sorted(abs(r["mem_err"]) for r in rows)
    tim = sorted(abs(r["time_err"]) for r in rows)
    return (f"{len(rows)} configurations. Memory |error|: median {100 * statistics.median(mem):.1f} %,"
            f" worst {100 * mem[-1]:.1f} %. Step time |error|: median "
            f"{100 * statistics.median(tim):.1f} %, worst {100 * tim[-1]:.1f} %; Spearman rank "
            f"correlation {spearman([r['pred_step_s'] for r in rows], [r['step_s'] for r in rows]):.2f}.")


def save_table(rows: list[dict]) -> str:
    """The save's own peak (a synchronous ``save_checkpoint`` after the timed steps)
    against the plan's save phase."""
    out = ["| shape | world | stage | offload | save peak measured MB | predicted MB | error |",
           "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['world']} | {r['stage']} | {r['offload']} | "
                   f"{r['save_peak'] / 1e6:,.0f} | {r['pred_save_peak'] / 1e6:,.0f} | "
                   f"{100 * r['save_err']:+.1f} % |")
    errors = sorted(abs(r["save_err"]) for r in rows)
    return "\n".join(out) + (f"\n\n{len(rows)} saves: |error| median "
                             f"{100 * statistics.median(errors):.1f} %, worst "
                             f"{100 * errors[-1]:.1f} %.")


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0.0] * len(xs)
        for i, j in enumerate(order):
            out[j] = i
        return out
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def choices(rows: list[dict], args) -> str:
    """``zf.plan``'s choice (what ``zf.auto`` applies) against measurement, per shape and
    world, under two host budgets: *roomy*, a tenth above the largest measured peak
    without offload (every candidate fits: the choice should be the fastest), and *tight*,
    the measured peaks' median (about half do not fit). Is the choice one that truly
    fits, and how does its measured step compare with the fastest that truly fits?"""
    out = ["| shape | world | budget | host budget MB | plan's choice | fits (measured) | "
           "its step s | fastest that fits | its step s | ratio |",
           "|---|---:|---|---:|---|---|---:|---|---:|---:|"]
    name = "{stage}/{offload}".format
    for shape, world in sorted({(r["shape"], r["world"]) for r in rows}):
        group = [r for r in rows if (r["shape"], r["world"]) == (shape, world)]
        if not any(r["offload"] == "none" for r in group):
            continue      # (no roomy budget to set)
        budgets = {"roomy": 1.1 * max(r["peak"] for r in group if r["offload"] == "none"),
                   "tight": statistics.median(r["peak"] for r in group)}
        for label, budget in budgets.items():
            best = min((r for r in group if r["peak"] <= budget), key=lambda r: r["step_s"])
            pick = choose(shape, world, group, budget, args)
            head = f"| {shape} | {world} | {label} | {budget / 1e6:,.0f} | "
            if pick is None:
                out.append(head + f"refused | — | — | {name(**best)} | {best['step_s']:.3f} "
                                  f"| — |")
                continue
            out.append(head + f"{name(**pick)} | {'yes' if pick['peak'] <= budget else 'NO'} | "
                       f"{pick['step_s']:.3f} | {name(**best)} | {best['step_s']:.3f} | "
                       f"{pick['step_s'] / best['step_s']:.2f} |")
    return "\n".join(out)


def choose(shape: str, world: int, group: list[dict], budget: float, args) -> dict | None:
    """The group's row ``zf.plan`` chooses within ``budget`` (its margin included), or None
    where it refuses."""
    from zerofn.planner import NoPlanFits, plan
    by = {candidate(r["stage"], r["offload"], args.batch): r for r in group}
    try:
        result = plan(model_of(shape, "meta"), FAMILIES[shape].inputs(args.batch, None),
                      world=world, only=list(by),
                      on_gpu=False, machine=machine_of(args.probe), host_budget=budget,
                      saves=None)
    except NoPlanFits:
        return None
    return by[result.choice]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    rows = []
    for shape, world, stage, off, got in measurements(args):
        pred = predict(shape, world, stage, off, args.batch, args.probe)
        row = dict(shape=shape, world=world, stage=stage, offload=off, **got,
                   pred_peak=pred["peak"], pred_step_s=pred["step_s"],
                   mem_err=pred["peak"] / got["peak"] - 1,
                   time_err=pred["step_s"] / got["step_s"] - 1)
        if "save_peak" in got:
            row.update(pred_save_peak=pred["save_peak"],
                       save_err=pred["save_peak"] / got["save_peak"] - 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print(summary(rows))
    print()
    print(choices(rows, args))
    if any("save_peak" in r for r in rows):
        print()
        print(save_table([r for r in rows if "save_peak" in r]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
