"""Single-GPU offload: zerofn ``offload("cpu")`` against FSDP2 ``CPUOffloadPolicy``.

    python tools/bench_offload.py                          # compare on the default sizes
    python tools/bench_offload.py --sizes 2048x24 --steps 5
    python tools/bench_offload.py --find-largest           # grow the model until it fails
    python tools/bench_offload.py --device cpu             # the CPU smoke run (< 1 minute)
    python tools/bench_offload.py --sizes 4096x34 --contenders zerofn --checkpoint on \
        --batch 4 --accum 32                               # throughput: 131k tokens/step
    python tools/bench_offload.py --find-largest --state-dtype int8 --master-dtype bf16
                                                           # 8-bit Adam state, bf16 masters
    python tools/bench_offload.py --sizes 2048x24 --contenders zerofn --offload-ratio auto \
        --device-budget 0.9 --adam-time                    # what fits stays on the device

The model is zerofn.nanogpt.GPT (width W, L blocks, W/64 heads, FFN 4W; a size is written
``WxL``), bf16 compute, AdamW, on one device with a world-1 process group (nccl on cuda,
gloo on cpu). Contenders, each built fresh in its own process on the same seed and data:

  zerofn   ZeRO-3 + mixed_precision(bf16) + offload("cpu"): fp32 masters and Adam state in
           one host arena, the step in zerofn's C++ CPU Adam. ``--state-dtype`` and
           ``--master-dtype`` store the moments (bf16, or 8-bit codes) and the masters (bf16)
           in fewer bytes: offload("cpu", state_dtype=..., master_dtype=...), see
           docs/offload.md ("Low-precision host state"). FSDP2 keeps fp32 state either way.
  FSDP2    fully_shard per block and at the root, MixedPrecisionPolicy(param_dtype=bf16,
           reduce_dtype=bf16) (zerofn reduces in bf16 too: the same bytes on the wire and
           across PCIe), CPUOffloadPolicy(), torch AdamW(fused=True) on the host (torch's
           fastest CPU AdamW, so the peer is not handicapped).
  deepspeed  (only when named in --contenders) DeepSpeed ZeRO-Offload, bf16, its CPU Adam:
           stage 2 with the optimizer on the host, or with --ds-ratio R stage 3 with
           offload_optimizer.ratio R (DeepSpeed takes a ratio at stage 3 only).
  nooffload  (only when named) zerofn ZeRO-3 + mixed_precision(bf16), no offload: the
           optimizer on the device, the throughput offload is measured against.

A step is ``--accum`` micro-batches of ``--batch`` sequences; gradients are reduced (and
offloaded) only on a step's last, as DDP's ``no_sync`` does (zerofn's ``model.no_sync()``,
FSDP2's ``set_requires_gradient_sync(False)``). The host's optimizer step does not shrink
with the batch, so throughput figures need many tokens per step; the comparison uses few,
where the offload machinery weighs most.

Each run takes ``--warmup`` untimed steps, then ``--steps`` timed ones, each fenced by
``torch.cuda.synchronize``; the step time is their median. tokens/s =
accum*batch*context / step time. TFLOP/s is the model-FLOPs convention for training,
6*N*tokens/s with N every parameter (the tied embedding once): attention scores and
checkpoint recompute are not counted, so it is comparable across contenders but below
the hardware's real rate.

Each run is a separate process: a CUDA OOM leaves the allocator fragmented and glibc keeps
freed heap, so nothing leaks from one contender into the next, and a run the kernel kills
for host memory is reported as such instead of ending the benchmark.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CONTENDERS = ("zerofn", "fsdp2")          # the default; deepspeed and nooffload when named
STORED = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}   # flag -> torch dtype
LABEL = {"zerofn": "zerofn offload", "fsdp2": "FSDP2 CPUOffload",
         "deepspeed": "DeepSpeed ZeRO-Offload", "nooffload": "zerofn, no offload"}
TARGET = 1.5        # issue 4: zerofn at least 1.5x FSDP2's tokens/s
# Per device: sizes compared, the find-largest ladder, and the batch shape. The cuda ladder
# climbs toward the host-RAM limit of a 128 GB machine (~14 host bytes per param).
DEFAULTS = {
    "cuda": dict(sizes="1024x24,2048x24", ladder="2048x24,3072x32,4096x32,4096x36,4096x40,5120x40",
                 vocab=50304, context=1024, batch=4, warmup=2, steps=5, timeout=600),
    "cpu": dict(sizes="64x2", ladder="64x2,128x2,128x4",
                vocab=256, context=32, batch=2, warmup=1, steps=3, timeout=120),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available")
    p.add_argument("--sizes", help="comma-separated WIDTHxLAYERS (with --find-largest: the ladder)")
    p.add_argument("--steps", type=int, help="timed steps per run")
    p.add_argument("--warmup", type=int, help="untimed steps per run")
    p.add_argument("--batch", type=int, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--context", type=int, help="tokens per sequence")
    p.add_argument("--vocab", type=int, help="vocabulary size")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset")
    p.add_argument("--checkpoint", choices=("auto", "on", "off"), default="auto",
                   help="activation checkpointing per block; auto: on for --find-largest only")
    p.add_argument("--offload-params", action="store_true",
                   help="zerofn: offload('cpu', params=True), ZeRO-3 param shards on the host too")
    p.add_argument("--nvme", metavar="DIR",
                   help="zerofn: offload('nvme', path=DIR): masters and Adam state in a swap "
                        "file there (with --offload-params the param shards too)")
    p.add_argument("--state-dtype", choices=tuple(STORED), default="fp32",
                   help="zerofn: offload(..., state_dtype=...), how Adam's moments are "
                        "stored on the host (int8: 8-bit codes, a scale per 256)")
    p.add_argument("--master-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="zerofn: offload(..., master_dtype=...), how the masters are stored "
                        "on the host (bf16: the rows the device computes with)")
    p.add_argument("--offload-ratio", type=offload_ratio, default=1.0,
                   help="zerofn: offload(..., ratio=...), the share of the optimizer state "
                        "offloaded, the rest staying on the device (default 1: all); 'auto': "
                        "after the first step as much as --device-budget holds stays")
    p.add_argument("--device-budget", type=device_budget,
                   help="zerofn with --offload-ratio auto: offload(device_budget=...), the "
                        "device memory the run may use: bytes (an integer) or a share of "
                        "the memory free at set-up (a number in (0, 1]; default 0.9)")
    p.add_argument("--adam-time", action="store_true",
                   help="zerofn: report the host Adam's own time a step, zerofn's cpu_adam "
                        "series, from zf.tensorboard(every=1, csv=True) in a temporary "
                        "directory (it writes a few scalars inside each timed step)")
    p.add_argument("--ds-ratio", type=float,
                   help="deepspeed: ZeRO-3 with offload_optimizer.ratio (its share of the "
                        "optimizer state on the host); without it ZeRO-2, all on the host")
    p.add_argument("--overlap-step", action="store_true",
                   help="zerofn: offload('cpu', overlap_step=True), the host steps each unit "
                        "during backward")
    p.add_argument("--find-largest", action="store_true",
                   help="climb the ladder of sizes with zerofn until one fails")
    p.add_argument("--host-limit-gb", type=float,
                   help="host RAM a run may use (default: MemAvailable at launch)")
    p.add_argument("--timeout", type=int, help="seconds per run before it counts as failed")
    p.add_argument("--worker", help=argparse.SUPPRESS)    # "contender:size", internal
    args = p.parse_args(argv)
    if args.overlap_step and args.nvme:
        p.error("--overlap-step steps the host offload's units; the NVMe swap file is "
                "stepped in its own order: drop one of them.")
    if args.device_budget is not None and args.offload_ratio != "auto":
        p.error("--device-budget is what --offload-ratio auto places against: give both.")
    unknown = set(args.contenders.split(",")) - set(LABEL)
    if unknown:
        p.error(f"unknown contender(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(LABEL)}")
    return _fill_defaults(args)


def offload_ratio(text: str) -> float | str:
    """``--offload-ratio``: 'auto', or a share from 0 to 1."""
    if text == "auto":
        return text
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share from 0 to 1, or 'auto'")
    return value


def device_budget(text: str) -> int | float:
    """``--device-budget``: bytes as an integer, or a share in (0, 1] of the free memory."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: bytes (an integer) or a share in (0, 1]")
    return value


def stored_dtypes(args) -> dict:
    """``--state-dtype``/``--master-dtype`` as torch dtypes: the keywords offload() and
    estimate_placement() take."""
    import torch
    return dict(state_dtype=getattr(torch, STORED[args.state_dtype]),
                master_dtype=getattr(torch, STORED[args.master_dtype]))


def estimate_keywords(args) -> dict:
    """What estimate_placement() counts of the offload flags: ratio 'auto' offloads every
    unit at set-up (the host's peak), and it and --overlap-step land gradients in a
    buffer per unit instead of the host ring."""
    auto = args.offload_ratio == "auto"
    return dict(stored_dtypes(args), ratio=1.0 if auto else args.offload_ratio,
                host_ring=not (auto or args.overlap_step))


def _fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.device is None:   # torch imports slowly: only the parent that must guess pays
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    d = DEFAULTS[args.device]
    for key in ("vocab", "context", "batch", "warmup", "steps", "timeout"):
        if getattr(args, key) is None:
            setattr(args, key, d[key])
    if args.sizes is None:
        args.sizes = d["ladder"] if args.find_largest else d["sizes"]
    if args.checkpoint == "auto":
        args.checkpoint = "on" if args.find_largest else "off"
    return args


def model_config(size: str, args):
    """``WxL`` as a GPTConfig: heads of 64 channels, FFN four times the width."""
    from zerofn.nanogpt import GPTConfig
    width, layers = (int(v) for v in size.lower().split("x"))
    return GPTConfig(vocab=args.vocab, width=width, heads=max(1, width // 64), ffn=4 * width,
                     layers=layers, context=args.context, checkpoint=args.checkpoint == "on")


# -- worker: one contender at one size, in its own process -------------------------------
def init_world_1(device: str) -> None:
    """A world-1 process group on a free local port: no launcher or environment needed."""
    import torch
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def build(contender: str, cfg, args, logdir: str | None = None):
    """The model built directly on the device (no host fp32 copy), wrapped as
    ``contender``: (model, optimizer), DeepSpeed's engine standing for both. ``logdir``:
    zerofn's monitor writes there (--adam-time)."""
    import torch

    from zerofn.nanogpt import GPT
    torch.manual_seed(0)
    with torch.device(args.device):
        model = GPT(cfg)
    if contender == "fsdp2":
        return build_fsdp2(model, args)
    if contender == "deepspeed":
        return build_deepspeed(model, args)
    return build_zerofn(model, args, offloaded=contender == "zerofn", logdir=logdir)


def build_zerofn(model, args, offloaded: bool, logdir: str | None):
    import torch

    import zerofn as zf
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    extra = ([_offload(args)] if offloaded else []) + \
        ([zf.tensorboard(logdir, every=1, csv=True)] if logdir else [])
    return zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                      zf.mixed_precision(torch.bfloat16), *extra)(model, opt)


def build_fsdp2(model, args):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(args.device, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # Pinning needs an accelerator; on a CPU-only machine FSDP2 refuses pin_memory=True.
    policy = CPUOffloadPolicy(pin_memory=args.device == "cuda")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def build_deepspeed(model, args):
    """The engine, standing for model and optimizer (``step_fns``). DeepSpeed joins the
    process group init_world_1 made; it reads its launcher's variables all the same."""
    import deepspeed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29533")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(args))
    return engine, None


def deepspeed_config(args) -> dict:
    """ZeRO-Offload as DeepSpeed's docs set it up: ZeRO-2 with the optimizer on the host;
    with ``--ds-ratio`` ZeRO-3 (the only stage its ``offload_optimizer.ratio`` exists at)."""
    offload = {"device": "cpu", "pin_memory": args.device == "cuda"}
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
            "offload_optimizer": offload}
    if args.ds_ratio is not None:
        zero["stage"] = 3
        offload["ratio"] = args.ds_ratio
    return {"train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": args.accum, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero}


def _offload(args):
    import zerofn as zf
    if args.nvme:
        return zf.offload("nvme", path=args.nvme, params=args.offload_params,
                          ratio=args.offload_ratio, **stored_dtypes(args))
    budget = {} if args.device_budget is None else dict(device_budget=args.device_budget)
    return zf.offload("cpu", params=args.offload_params, overlap_step=args.overlap_step,
                      ratio=args.offload_ratio, **budget, **stored_dtypes(args))


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def reducing(model, last: bool):
    """The context of one micro-batch's backward: gradient reduction only on a step's last."""
    if hasattr(model, "set_requires_gradient_sync"):    # FSDP2
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else model.no_sync()


def step_fns(model, opt, args):
    """``(micro, finish)``: ``micro(x, y, last)`` runs one micro-batch's forward and
    backward and returns its share of the step's loss; ``finish()`` ends the step."""
    if opt is None:      # DeepSpeed's engine: it scales by its own accumulation steps and
        def micro(x, y, last):               # steps the optimizer at their boundary
            loss = model(x, y)
            model.backward(loss)
            model.step()
            return loss.detach() / args.accum
        return micro, lambda: None

    def micro(x, y, last):
        with reducing(model, last):
            loss = model(x, y) / args.accum
            loss.backward()
        return loss.detach()

    def finish():
        opt.step()
        opt.zero_grad()
    return micro, finish


def timed_steps(model, opt, cfg, args) -> tuple[list[float], list[float]]:
    """Seconds of each timed step, and the loss of every step (warm-up included)."""
    import torch
    g = torch.Generator().manual_seed(1)
    n = args.warmup + args.steps
    tokens = torch.randint(cfg.vocab, (n, args.accum, args.batch, cfg.context + 1), generator=g)
    tokens = tokens.to(args.device)
    micro, finish = step_fns(model, opt, args)
    times, losses = [], []
    for i in range(n):
        sync(args.device)
        start = time.perf_counter()
        loss = 0.0
        for j in range(args.accum):
            x, y = tokens[i, j, :, :-1].contiguous(), tokens[i, j, :, 1:].contiguous()
            loss = loss + micro(x, y, last=j == args.accum - 1)
        finish()
        sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss)
    return times, [float(v) for v in losses]


def peak_host_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def run_one(contender: str, size: str, args) -> dict:
    import torch
    cfg = model_config(size, args)
    with tempfile.TemporaryDirectory() as logdir:
        timed = logdir if args.adam_time and contender == "zerofn" else None
        model, opt = build(contender, cfg, args, logdir=timed)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()   # the training peak, not the fp32 build
        times, losses = timed_steps(model, opt, cfg, args)
        adam = median_after(os.path.join(logdir, "time_cpu_adam.csv"), args.warmup) \
            if timed else None
    step = statistics.median(times)
    tok = args.batch * args.accum * cfg.context / step
    out = dict(status="ok", params=cfg.params(), step_s=step, tokens_per_s=tok,
               tflops=6 * cfg.params() * tok / 1e12, loss_first=losses[0], loss_last=losses[-1],
               peak_host=peak_host_bytes(),
               peak_device=torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
               env=f"{where(args.device)}, torch {torch.__version__}")
    if contender == "zerofn":
        out.update(placement(model), cpu_adam_s=adam)
    if contender == "deepspeed":
        import deepspeed
        out["version"] = deepspeed.__version__
    return out


def placement(model) -> dict:
    """Where zerofn's optimizer state ended up: host bytes, the units whose state stays
    on the device (--offload-ratio), and ratio='auto''s reason once the first step placed
    them (None otherwise)."""
    import zerofn as zf
    from zerofn.runtime import runtime_of
    rt = runtime_of(model)
    return dict(host_state=sum(zf.model_state_bytes(model).get("host", {}).values()),
                units_on_device=len(rt.units_on_device()), placement=rt.placement_reason())


def median_after(path: str, warmup: int) -> float | None:
    """The median, in seconds, of a monitor's CSV series (``step,ms`` rows, one a step
    at every=1) over the steps after ``warmup``; None where it has none (no host Adam)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [ln.split(",") for ln in f.read().splitlines()[1:]]
    ms = [float(v) for step, v in rows if int(step) > warmup]
    return statistics.median(ms) / 1e3 if ms else None


def where(device: str) -> str:
    import torch
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU only"


def failure(e: BaseException) -> dict | None:
    """A run that failed for memory, as a result; None for anything else (a real error)."""
    import torch
    text = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return dict(status="oom-device", reason=text)
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e):
        return dict(status="oom-host", reason=text)
    return None


def worker(args) -> None:
    contender, size = args.worker.split(":")
    import torch.distributed as dist
    init_world_1(args.device)
    try:
        result = run_one(contender, size, args)
    except (RuntimeError, MemoryError) as e:   # torch.cuda.OutOfMemoryError is a RuntimeError
        result = failure(e)
        if result is None:
            raise
        result["params"] = model_config(size, args).params()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


# -- launcher ----------------------------------------------------------------------------
def forwarded(args) -> list[str]:
    """The flags a worker needs, as the launcher was given them."""
    keys = ("device", "vocab", "context", "batch", "accum", "warmup", "steps", "checkpoint",
            "state_dtype", "master_dtype", "offload_ratio", "device_budget", "ds_ratio", "nvme")
    flags = [a for k in keys if getattr(args, k) is not None
             for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    switches = ("offload_params", "overlap_step", "adam_time")
    return flags + [f"--{k.replace('_', '-')}" for k in switches if getattr(args, k)]


def launch(contender: str, size: str, args) -> dict:
    """One run in a fresh process; a crash or kill becomes a failed result with a reason."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{contender}:{size}",
           "--sizes", size] + forwarded(args)
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # less fragmentation
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status="timeout", reason=f"no result within {args.timeout} s")
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[len("RESULT "):])
    if done.returncode in (-9, 137):
        return dict(status="killed", reason="SIGKILL (the kernel's OOM killer: host RAM)")
    tail = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return dict(status="error", reason=(tail[-1] if tail else f"exit {done.returncode}")[:300])


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))


def host_need(config, args) -> int:
    """Host bytes zerofn offload needs for the GPT ``config``, with a margin: the host
    state as ``estimate_placement`` counts it for ZeRO-3 at world 1 with ``--state-dtype``
    and ``--master-dtype`` (at fp32: master + Adam m, v, 12 B/param, and the host ring of
    three units' bf16 gradients, over which the step writes their bf16 rows; with
    --offload-params a landing buffer, 2, and the param shards, 2; with int8 moments and
    bf16 masters 4.03 + the ring; under --offload-ratio auto, which offloads every unit
    until the first step, or --overlap-step a landing buffer and a compute copy per unit
    instead of the ring, 4); with --nvme only the landing buffer (the rest is in the
    swap file, the staging ring is a few units); on a CPU device the "device" bf16 shard
    and gradient shard (4) are host memory too. The margin is small on CUDA, where those
    are page-locked arenas made once at their exact size, and larger on the CPU, where the
    allocator keeps freed blocks of the training itself."""
    import torch

    from zerofn.core.estimate import estimate_placement
    from zerofn.nanogpt import GPT
    with torch.device("meta"):        # the shape only, for the largest unit
        model = GPT(config)
    placed = estimate_placement(model, 1, 3, torch.bfloat16,
                                offload="nvme" if args.nvme else "cpu",
                                offload_params=args.offload_params, **estimate_keywords(args))
    need = placed["host"]["total"] + placed["device"]["total"] * (args.device == "cpu")
    if args.device == "cuda":
        return int(1.05 * need) + 3 * 2**30      # + libraries, CUDA context
    return int(1.15 * need) + 2**29


def nvme_need(params: int, args) -> int:
    """Swap-file bytes: masters and moments as stored (12 B/param at fp32, as
    ``estimate_placement`` counts them), + the bf16 param shards with --offload-params
    (2), rounded up a little for per-unit alignment."""
    import torch
    from zerofn.core.estimate import estimate_placement
    state = estimate_placement(params, 1, 3, torch.bfloat16, offload="nvme",
                               **estimate_keywords(args))["nvme"]["optimizer"]
    return int(1.01 * (state + 2 * args.offload_params * params))


def compare(args) -> list[dict]:
    rows = []
    for size in args.sizes.split(","):
        for contender in args.contenders.split(","):
            r = launch(contender, size, args)
            r.update(contender=contender, size=size, params=model_config(size, args).params())
            rows.append(r)
            print(f"# {size} {contender}: {r['status']}", file=sys.stderr, flush=True)
    return rows


def find_largest(args) -> list[dict]:
    """zerofn up the ladder; stop at the first size that fails or would not fit the host."""
    limit = args.host_limit_gb * 2**30 if args.host_limit_gb else mem_available()
    rows = []
    for size in args.sizes.split(","):
        params = model_config(size, args).params()
        need = host_need(model_config(size, args), args)
        disk = shutil.disk_usage(args.nvme).free if args.nvme else None
        if need > limit:
            r = dict(status="skipped", reason=f"needs ~{need / 2**30:.3g} GB host, "
                     f"{limit / 2**30:.3g} GB available")
        elif disk is not None and nvme_need(params, args) > disk:
            r = dict(status="skipped", reason=f"needs ~{nvme_need(params, args) / 2**30:.3g} "
                     f"GB of NVMe, {disk / 2**30:.3g} GB free at {args.nvme}")
        else:
            r = launch("zerofn", size, args)
        r.update(contender="zerofn", size=size, params=params)
        rows.append(r)
        print(f"# {size}: {r['status']}", file=sys.stderr, flush=True)
        if r["status"] != "ok":
            break
    return rows


# -- report ------------------------------------------------------------------------------
def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def gb(v) -> str:
    return "—" if v is None else f"{v / 2**30:.2f}"


def row_text(r: dict, peer: dict | None) -> str:
    name = f"{r['size']} ({count(r['params'])})"
    if r["status"] != "ok":
        return f"| {name} | {LABEL[r['contender']]} | {r['status']}: {r['reason']} |||||||"
    ratio = "—"
    if peer is not None and peer.get("status") == "ok":
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}×"
    return (f"| {name} | {LABEL[r['contender']]} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | "
            f"{1e3 * r['step_s']:.1f} | {ratio} | {r['loss_first']:.3f} → {r['loss_last']:.3f} | "
            f"{gb(r['peak_device'])} | {gb(r['peak_host'])} |")


def table(rows: list[dict]) -> str:
    out = ["| model (params) | contender | tokens/s | TFLOP/s (6N) | step ms | zerofn / FSDP2 "
           "| loss first → last | peak GPU GB | peak host RSS GB |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        peer = next((p for p in rows if p["size"] == r["size"] and p["contender"] == "fsdp2"),
                    None) if r["contender"] == "zerofn" else None
        out.append(row_text(r, peer))
    return "\n".join(out)


def header(rows: list[dict], args) -> str:
    env = next((r["env"] for r in rows if "env" in r), f"{args.device} (no run finished)")
    return (f"{env}, world 1; bf16 compute, AdamW; "
            f"{args.accum}x{args.batch}x{args.context} tokens/step, vocab {args.vocab}, activation "
            f"checkpointing {args.checkpoint}; zerofn offload("
            f"{repr('nvme') + ', path=...' if args.nvme else repr('cpu')}"
            f"{', params=True' if args.offload_params else ''}{stored_text(args)}); "
            f"{ds_text(args)}median of {args.steps} timed steps after {args.warmup} warm-up; "
            f"TFLOP/s = 6*N*tokens/s (model FLOPs)")


def ds_text(args) -> str:
    """DeepSpeed's configuration as the header names it, where it runs."""
    if "deepspeed" not in args.contenders.split(","):
        return ""
    stage = "ZeRO-2" if args.ds_ratio is None else f"ZeRO-3, offload_optimizer.ratio={args.ds_ratio:g}"
    return f"DeepSpeed {stage}; "


def stored_text(args) -> str:
    """offload()'s stored dtypes as the header names them: nothing at fp32."""
    text = "" if (args.state_dtype, args.master_dtype) == ("fp32", "fp32") else \
        f", state_dtype={args.state_dtype}, master_dtype={args.master_dtype}"
    if args.offload_ratio != 1.0:
        text += f", ratio={args.offload_ratio!r}" if args.offload_ratio == "auto" else \
            f", ratio={args.offload_ratio:g}"
    if args.device_budget is not None:
        text += f", device_budget={args.device_budget!r}"
    return text + (", overlap_step=True" if args.overlap_step else "")


def summary(rows: list[dict], args) -> list[str]:
    lines = []
    for r in rows:
        peer = next((p for p in rows if p["size"] == r["size"] and p["contender"] == "fsdp2"), None)
        if r["contender"] != "zerofn" or r["status"] != "ok" or not peer:
            continue
        if peer["status"] != "ok":
            lines.append(f"{r['size']}: no ratio, FSDP2 did not run ({peer['status']}).")
            continue
        ratio = r["tokens_per_s"] / peer["tokens_per_s"]
        if args.device == "cpu":   # no PCIe, tiny model: this is per-step framework overhead
            lines.append(f"{r['size']}: zerofn/FSDP2 = {ratio:.2f}× on CPU only; not evidence "
                         f"either way for the {TARGET}× GPU target")
            continue
        verdict = "meets" if ratio >= TARGET else "misses"
        lines.append(f"{r['size']}: zerofn/FSDP2 = {ratio:.2f}×, {verdict} the {TARGET}× target")
    return lines


def notes(rows: list[dict]) -> list[str]:
    """What zerofn's runs placed where (--offload-ratio) and the host Adam's own time
    (--adam-time), for the runs that measured them."""
    lines = []
    for r in rows:
        if r.get("placement"):
            lines.append(f"{r['size']}: {r['placement']}")
        elif r.get("units_on_device"):
            lines.append(f"{r['size']}: {r['units_on_device']} units keep their optimizer "
                         "state on the device")
        if r.get("cpu_adam_s"):
            lines.append(f"{r['size']}: host Adam {1e3 * r['cpu_adam_s']:.1f} ms a step, the "
                         f"step {r['step_s'] / r['cpu_adam_s']:.2f}× that")
    return lines


def largest_summary(rows: list[dict]) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    best = (f"largest that trained: {ok[-1]['size']} = {count(ok[-1]['params'])} params, "
            f"{ok[-1]['tokens_per_s']:,.0f} tokens/s, {ok[-1]['tflops']:.3g} TFLOP/s"
            if ok else "no size trained")
    stop = rows[-1]
    if stop["status"] == "ok":
        return best + "; the ladder ended without a failure (add larger --sizes to go on)"
    return best + f"; stopped at {stop['size']}: {stop['status']} ({stop['reason']})"


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    rows = find_largest(args) if args.find_largest else compare(args)
    print(header(rows, args) + "\n")
    print(table(rows))
    print()
    for line in ([largest_summary(rows)] if args.find_largest else summary(rows, args)) + \
            notes(rows):
        print(line)
    sys.stdout.flush()
    if not any(r["status"] == "ok" for r in rows):
        sys.exit(1)    # nothing measured: make the failure visible to scripts


if __name__ == "__main__":
    main()
