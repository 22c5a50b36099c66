"""Step time, peak memory and traffic per rank: DDP, FSDP2 and zerofn ZeRO-1/2/3.

    python3 tools/bench_zero.py                 # memory table, then step-time ratios
    python3 tools/bench_zero.py --mode time --vocab 4096 --width 256 --layers 4

One GPT-style model (~23M params by default), fp32 AdamW, 2 gloo ranks, 1 thread per rank.

Memory: every config runs in a fresh pair of processes (``torchrun`` per config, repeated
in rotating order): glibc keeps freed heap, so a second config in the same process would
start from a high-water mark it did not cause. Each worker takes its memory baseline
after imports and process-group set-up, resets the kernel's high-water mark, builds the
model, then runs warm-up and timed steps; the peak is the rise of VmHWM over that baseline.

Step time: each zerofn stage and its peer (DDP for ZeRO-1/2, FSDP2 for ZeRO-3) are built
in the same pair of processes and stepped in pairs, the order alternating (peer first,
then zerofn first), each step timed on its own between barriers; a step's time is the
slower rank's. The result is the median of the per-pair ratios zerofn / peer: noise from
other work on shared cores hits both steps of a pair alike and cancels in the ratio,
where best-of-N step times of separate runs do not.

Traffic is the payload of every collective per rank per step (the full buffer of an
all-gather or reduce-scatter, the tensor of an all-reduce), counted by wrapping the
``torch.distributed`` functions FSDP2 and zerofn call, and for DDP (whose reducer calls
the process group from C++) by a comm hook doing exactly DDP's default all-reduce.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

CONFIGS = ("ddp", "zero1", "zero2", "fsdp2", "zero3", "zero3-meta")
PEER = {"zero1": "ddp", "zero2": "ddp", "zero3": "fsdp2", "zero3-meta": "fsdp2"}
# Model-state bytes per rank for fp32 AdamW, as multiples of the parameter count (N ranks).
FORMULA = {"ddp": lambda n: 16, "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 12 / n,
           "zero3": lambda n: 16 / n, "zero3-meta": lambda n: 16 / n, "fsdp2": lambda n: 16 / n}
LABEL = {"ddp": "DDP", "fsdp2": "FSDP2", "zero1": "zerofn ZeRO-1", "zero2": "zerofn ZeRO-2",
         "zero3": "zerofn ZeRO-3", "zero3-meta": "zerofn ZeRO-3, built on meta"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("all", "memory", "time"), default="all",
                   help="memory: peak RSS and traffic per config; time: paired step-time ratios")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configs to run")
    p.add_argument("--pairs", type=int, default=30, help="timed step pairs per zerofn stage")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of every config, in rotating order, to average out noise")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--vocab", type=int, default=8192, help="model vocabulary")
    p.add_argument("--width", type=int, default=512, help="model width")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--context", type=int, default=64, help="sequence length")
    p.add_argument("--return-freed", action="store_true",
                   help="run every config with glibc returning freed blocks of 64 KiB and more to "
                        "the OS at once (MALLOC_MMAP_THRESHOLD_), so peak RSS shows what each "
                        "framework holds rather than what the allocator kept; slower steps")
    p.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--pair-worker", choices=tuple(PEER), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker: one config, under torchrun --------------------------------------------------
def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def count_collectives(counts: Counter) -> None:
    """Wrap the torch.distributed collectives so each call adds its payload bytes."""
    import inspect

    import torch.distributed as dist

    def wrap(name: str, payload_index: int):
        plain = getattr(dist, name, None)
        if plain is None:   # all_gather_single / reduce_scatter_single: torch 2.13+ only
            return
        signature = inspect.signature(plain)

        def counted(*args, **kwargs):
            # FSDP2 passes tensors by keyword, zerofn by position: bind to read either.
            t = list(signature.bind(*args, **kwargs).arguments.values())[payload_index]
            parts = t if isinstance(t, (list, tuple)) else [t]
            counts[name] += sum(p.numel() * p.element_size() for p in parts)
            return plain(*args, **kwargs)
        setattr(dist, name, counted)

    # the gathered output; the reduced tensor; on gloo zerofn gathers with one broadcast
    # per rank's chunk (zerofn/runtime/comm.py)
    for name in ("all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast"):
        wrap(name, 0)
    # the full input
    for name in ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"):
        wrap(name, 1)
    # on gloo zerofn reduce-scatters with one all-to-all: world chunks, each to its rank
    # (at two ranks only the other rank's is sent, named by the split sizes)
    a2a, world = dist.all_to_all_single, dist.get_world_size()

    def all_to_all(out, inp, out_splits=None, in_splits=None, *args, **kwargs):
        chunks = world * max(in_splits) if in_splits else inp.numel()
        counts["all_to_all_single"] += chunks * inp.element_size()
        return a2a(out, inp, out_splits, in_splits, *args, **kwargs)
    dist.all_to_all_single = all_to_all


def build(config: str, args):
    """A fresh model and AdamW wrapped as ``config``, same seed for every config."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import zerofn as zf
    from zerofn.nanogpt import GPT, GPTConfig, init_weights

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, width=args.width, heads=args.width // 64,
                    ffn=4 * args.width, layers=args.layers, context=args.context)
    # zero3-meta: no full parameters ever exist on a rank (and none are freed at set-up,
    # which would raise glibc's mmap threshold to the size of the largest)
    with torch.device("meta" if config.endswith("-meta") else "cpu"):
        model = GPT(cfg)
    if config == "ddp":
        # The causal masks are constant, so re-broadcasting them every forward is waste.
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        # DDP's own all-reduce, but issued from Python, where count_collectives sees it.
        model.register_comm_hook(None, allreduce_hook)
    elif config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if config.startswith("zero"):
        # The fixed threshold docs/benchmarks.md measures zerofn under (the process is
        # the config's own; a transform alone leaves malloc as it is).
        zf.return_large_frees()
        stage = int(config[4])
        t = [zf.shard_optimizer(), zf.shard_grads(),
             zf.shard_params(init=init_weights if config.endswith("-meta") else None)][:stage]
        model, opt = zf.compose(*t)(model, opt)
    return model, opt


def timed_steps(model, opt, args, counts: Counter) -> tuple[list[float], int]:
    """Per-step seconds of the timed steps, and the payload bytes of the last one."""
    x, y = rank_batch(args)
    times = []
    for i in range(args.warmup + args.steps):
        counts.clear()
        seconds = one_step(model, opt, x, y)
        if i >= args.warmup:
            times.append(seconds)
    return times, sum(counts.values())


def one_step(model, opt, x, y) -> float:
    """Seconds of one training step on this rank, started together with the other ranks."""
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def rank_batch(args):
    """This rank's slice of a fixed global batch."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(args.vocab, (args.batch * world, args.context + 1), generator=g)
    return x[:, :-1].chunk(world)[rank].contiguous(), x[:, 1:].chunk(world)[rank].contiguous()


def prime(args) -> None:
    """Run the config once on a tiny model, so the baseline already holds the code pages,
    thread stacks and library state that any first step faults in, and only model-sized
    memory counts as the rise."""
    tiny = argparse.Namespace(**{**vars(args), "vocab": 256, "width": 64, "layers": 1,
                                 "warmup": 2, "steps": 0})
    model, opt = build(args.worker, tiny)
    timed_steps(model, opt, tiny, Counter())
    del model, opt


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counts: Counter = Counter()
    count_collectives(counts)
    prime(args)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")       # reset VmHWM to the current RSS
    base_kb = proc_status_kb("VmRSS")
    model, opt = build(args.worker, args)
    params = sum(p.numel() for p in {id(p): p for p in _full_params(model)}.values())
    times, comm = timed_steps(model, opt, args, counts)
    mine = dict(step_s=statistics.median(times), peak_rise=(proc_status_kb("VmHWM") - base_kb) * 1024,
                comm=comm, params=params)
    if args.worker.startswith("zero"):
        import zerofn as zf
        mine["zerofn_comm"] = sum(v for k, v in zf.comm_stats(model).items() if k.endswith("_bytes"))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    # Free zerofn's model/runtime cycle now, not at interpreter shutdown (see zerofn.train).
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def pair_worker(args) -> None:
    """A zerofn stage and its peer in the same processes, stepped in pairs of alternating
    order; prints each pair's slower-rank step times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = args.pair_worker
    contenders = (PEER[config], config)
    built = {c: build(c, args) for c in contenders}
    x, y = rank_batch(args)
    times = {c: [] for c in contenders}
    for i in range(args.warmup + args.pairs):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            seconds = one_step(*built[c], x, y)
            if i >= args.warmup:
                times[c].append(seconds)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if dist.get_rank() == 0:
        slowest = {c: [max(r[c][i] for r in everyone) for i in range(args.pairs)]
                   for c in contenders}
        print("RESULT " + json.dumps(slowest), flush=True)
    del built
    gc.collect()
    dist.destroy_process_group()


def paired_summary(config: str, times: dict) -> dict:
    """Median step times, and the median and quartiles of the per-pair ratios."""
    peer = PEER[config]
    ratios = sorted(b / a for a, b in zip(times[peer], times[config]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return dict(config=config, peer=peer, pairs=len(ratios), ratio=statistics.median(ratios),
                q1=q[0], q3=q[2], step_ms=1e3 * statistics.median(times[config]),
                peer_ms=1e3 * statistics.median(times[peer]))


def paired_table(rows: list[dict]) -> str:
    out = ["| config | step ms | peer | peer step ms | median per-pair ratio | quartiles |",
           "|---|---:|---|---:|---:|---|"]
    for r in rows:
        out.append(f"| {LABEL[r['config']]} | {r['step_ms']:.1f} | {LABEL[r['peer']]} | "
                   f"{r['peer_ms']:.1f} | {r['ratio']:.3f}× | {r['q1']:.3f}–{r['q3']:.3f} |")
    return "\n".join(out)


def _full_params(model):
    from torch.distributed.tensor import DTensor
    for p in model.parameters():
        yield p if not isinstance(p, DTensor) else p.to_local().new_empty(p.shape, device="meta")


# -- launcher ----------------------------------------------------------------------------
def launch(config: str, args, role: str = "--worker"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, role, config] + _forwarded(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.return_freed:
        # A fixed threshold also stops glibc raising it (and keeping freed blocks) after
        # the first large free; see docs/benchmarks.md.
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"{config} failed:\n{done.stdout}\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def _forwarded(args) -> list[str]:
    keys = ("warmup", "steps", "pairs", "batch", "vocab", "width", "layers", "context")
    return [a for k in keys for a in (f"--{k}", str(getattr(args, k)))]


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Per config: the slowest rank's median step, taking the least disturbed run (other
    jobs share the cores, and noise only ever adds time); the worst rank's peak, median
    over runs."""
    out = {}
    for config, results in runs.items():
        params, world = results[0][0]["params"], len(results[0])
        peak = statistics.median(max(r["peak_rise"] for r in ranks) for ranks in results)
        out[config] = dict(
            step_ms=1e3 * min(max(r["step_s"] for r in ranks) for ranks in results),
            peak_mb=peak / 2**20, formula_mb=FORMULA[config](world) * params / 2**20,
            comm_mb=results[-1][0]["comm"] / 2**20, params=params, world=world,
            zerofn_comm_mb=results[-1][0].get("zerofn_comm", 0) / 2**20)
    return out


def table(s: dict[str, dict]) -> str:
    rows = ["| config | step ms | vs peer | peak RSS MB | formula MB | RSS / formula | MB comm / step |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        if config not in s:
            continue
        r = s[config]
        peer = PEER.get(config)
        ratio = f"{r['step_ms'] / s[peer]['step_ms']:.2f}× {LABEL[peer]}" if peer in s else "—"
        rows.append(f"| {LABEL[config]} | {r['step_ms']:.0f} | {ratio} | {r['peak_mb']:.0f} | "
                    f"{r['formula_mb']:.0f} | {r['peak_mb'] / r['formula_mb']:.2f} | "
                    f"{r['comm_mb']:.1f} |")
    return "\n".join(rows)


def memory_runs(args) -> None:
    configs = args.configs.split(",")
    runs: dict[str, list] = {c: [] for c in configs}
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for config in order:
            runs[config].append(launch(config, args))
            print(f"# repeat {rep + 1}: {config} done", file=sys.stderr, flush=True)
    s = summarize(runs)
    first = next(iter(s.values()))
    print(f"GPT {first['params'] / 1e6:.1f}M params, fp32 AdamW, {first['world']} gloo ranks, "
          f"1 thread each, {args.batch}x{args.context} tokens per rank; step time: median of "
          f"{args.steps} steps, best of {args.repeats} runs"
          + (", freed memory returned to the OS (MALLOC_MMAP_THRESHOLD_=65536)" if args.return_freed
             else "") + "\n")
    print(table(s))
    for config, r in s.items():
        if r["zerofn_comm_mb"]:
            print(f"\n{LABEL[config]}: zf.comm_stats says {r['zerofn_comm_mb']:.1f} MB", end="")
    print()


def time_runs(args) -> None:
    from zerofn.nanogpt import GPTConfig
    stages = [c for c in args.configs.split(",") if c in PEER]
    rows = [paired_summary(c, launch(c, args, "--pair-worker")) for c in stages]
    params = GPTConfig(vocab=args.vocab, width=args.width, heads=args.width // 64,
                       ffn=4 * args.width, layers=args.layers, context=args.context).params()
    print(f"GPT {params / 1e6:.1f}M params, fp32 AdamW, 2 gloo ranks, 1 thread each, "
          f"{args.batch}x{args.context} tokens per rank; {args.pairs} step pairs after "
          f"{args.warmup} warm-up pairs, order alternating; a step's time is the slower "
          "rank's\n")
    print(paired_table(rows))


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    if args.pair_worker:
        return pair_worker(args)
    if args.mode in ("all", "memory"):
        memory_runs(args)
    if args.mode in ("all", "time"):
        time_runs(args)


if __name__ == "__main__":
    main()
