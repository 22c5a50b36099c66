"""The one command for a lent GPU: what zerofn's CUDA path does that a CPU cannot show.

    python tools/gpu_check.py                            # every part
    python tools/gpu_check.py --parts build,tests,race   # some parts; results accumulate
    python tools/gpu_check.py --parts build,pending --budget 540
                                  # the parts not passed yet that fit in 540 s, after a build
    python tools/gpu_check.py --plan                     # docs/gpu.md as "not yet run"

It runs offline on a machine with a CUDA build of torch (2.11 or later) installed and no
package index. Each part is recorded whether it passes or fails, and a failure does not
stop the parts after it; docs/gpu.md is rewritten from every result so far after each
part, so a run cut short still leaves a report. Results accumulate in ``--results``
(docs/gpu_results.json, committed beside the report, so a later session on another
machine goes on with the parts still pending), each with the device, torch and commit it
ran on. ``--copy-to DIR`` also copies the report, the results and the profiler trace
there. Nothing in the report is written by hand: every figure comes from a run.

The parts come in the order of what a short lease should show first: that zerofn builds
and trains correctly on CUDA, then the goals, then the stress and peer runs. A lease of
15 minutes of device time (a start of a minute or two included) fits one command of
``--parts build,pending --budget 540`` and a second, shorter one of what is left; the
int8-state ladder (``largest_int8``, up to 13.2B, 8 minutes) takes a command of its own,
``--parts build,largest_int8 --budget 540``. "Offload only what does not fit" takes two
commands of its own, ``--parts build,split,split_ds --budget 540`` (about 2 minutes, 5
with DeepSpeed) and ``--parts build,split_7b --budget 540`` (about 5 minutes).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS, TESTS = os.path.join(ROOT, "tools"), os.path.join(ROOT, "tests")
REPORT = os.path.join(ROOT, "docs", "gpu.md")
RESULTS = os.path.join(ROOT, "docs", "gpu_results.json")
TRACE_DIR = os.path.join(ROOT, "build", "gpu_check")   # the profiler trace: too big for docs/
TOL = 1e-5                     # parity, as tests/test_parity.py
COMPARE_SIZE = "2048x24"       # zerofn against FSDP2 (and DeepSpeed)
LARGE_CPU = "4096x34"          # 7.06B parameters: the >= 7B goal with Adam on the host
# 8-bit Adam moments and bf16 masters: 6.03 host bytes a parameter (fp32 state: 16), so
# 13.2B needs ~81 GiB of host; 7.06B first, the size of the fp32 part, to compare with.
LARGE_INT8_LADDER = ("4096x34", "5120x36", "5120x41")
INT8_STATE = "--state-dtype int8 --master-dtype bf16"
NVME_LADDER = ("5120x41", "4096x34", "3072x32", "2048x24")   # 13.2B first: the 13B goal
# The host's Adam step takes seconds at 7B whatever the batch: a throughput figure needs
# many tokens per step, accumulated under no_sync, as a real 7B run would.
THROUGHPUT = "--batch 4 --accum 32 --warmup 1 --steps 2"
# "Offload only what does not fit": 4096 tokens a step at 1.31B (one micro-batch, as
# compare), 16k at 7B; 2 warm-up steps at 1.31B, so that ratio="auto"'s first timed step
# is not its first after the placement.
SPLIT = "--warmup 2 --steps 3"
TOKENS_16K = "--batch 4 --accum 4 --warmup 1 --steps 2"
DS_RATIOS = (0.3, 0.6, 1.0)    # DeepSpeed's offload_optimizer.ratio (ZeRO-3 only)
GOALS = {"ratio": 1.5, "largest_cpu": 7e9, "largest_int8": 13e9, "largest_nvme": 13e9,
         "tflops_7b": 300.0, "tflops_7b_auto": 450.0, "auto_vs_fsdp2": 3.0,
         "step_vs_adam": 1.15, "vs_deepspeed": 1.3}


@dataclass(frozen=True)
class Part:
    name: str
    minutes: float      # the part's time limit
    what: str           # what it runs and shows, for the plan and the report


PARTS = [
    Part("build", 1, "`pip install --no-build-isolation --no-deps -e .` builds the C++ CPU Adam "
         "(`setup.py build_ext --inplace` where pip cannot install); the kernel's instruction "
         "set and threads are recorded."),
    Part("tests", 2.5, "The CUDA tests: `tests/test_cuda.py` (offload arenas page-locked at "
         "their exact size; forward and backward under `torch.cuda.set_sync_debug_mode('error')`"
         " and the synchronizations of a step; async checkpoints staged through one pinned "
         "buffer; a transformers mixture of experts under ZeRO-3 + bf16, whose grouped GEMM "
         "needs 16-byte-aligned weights; experts that sit out on one rank under ZeRO-3, "
         "reduced from the side stream) and `tests/test_offload_copies.py`'s copy streams "
         "against blocking copies, bit for bit, in every offload configuration."),
    Part("parity", 1, "Parity with plain PyTorch on the same device, worlds 2 and 3 sharing "
         "the one GPU over gloo with CUDA tensors (rows not divisible by the world): ZeRO-1/2/3, "
         "accumulation, clipping, SGD, and offload('cpu') with params=True."),
    Part("job", 1.5, "README's main job, `python -m zerofn train` (ZeRO-3 on the built-in corpus, "
         "one rank on NCCL, with `--tensorboard`): stopped at step 100 of 200 with a checkpoint, "
         "then resumed from it to the end; the losses, throughput and peak memory it prints."),
    Part("largest", 3, f"`bench_offload.py --find-largest --sizes {LARGE_CPU} {THROUGHPUT}` "
         "(7.06B parameters, fp32 master and Adam state on the host, activation "
         "checkpointing): it trains, and at 32 micro-batches of 4x1024 tokens a step (131k "
         "tokens, reduced and offloaded once) it gives the TFLOP/s at 7B."),
    Part("largest_int8", 8, f"`bench_offload.py --find-largest --sizes "
         f"{','.join(LARGE_INT8_LADDER)} {THROUGHPUT} {INT8_STATE}` (7.06B, 11.6B, then 13.2B "
         "parameters; 8-bit Adam moments and bf16 masters on the host, "
         "`offload('cpu', state_dtype=torch.int8, master_dtype=torch.bfloat16)`: 6.03 host "
         "bytes a parameter against fp32 state's 16, ~81 GiB at 13.2B; activation "
         "checkpointing): up the ladder until a size fails or would not fit the host, and "
         "the TFLOP/s at the largest that trained, at the same 131k tokens a step as the "
         "fp32-state part."),
    Part("compare", 2, f"`tools/bench_offload.py --sizes {COMPARE_SIZE}`: zerofn offload('cpu') "
         "against FSDP2 CPUOffloadPolicy, both bf16 compute and bf16 reduction, tokens/s and "
         "TFLOP/s."),
    Part("split", 2.5, f"Offload only what does not fit, at {COMPARE_SIZE} (1.31B) and 4096 "
         f"tokens a step (`bench_offload.py --sizes {COMPARE_SIZE} {SPLIT}`), each run in its "
         "own process: zerofn full offload with `--adam-time` (the host Adam's own time a "
         "step, zerofn's `cpu_adam` series), zerofn `--offload-ratio auto` (the default "
         "budget, 0.9 of the free device memory; its placement), and FSDP2 "
         "CPUOffloadPolicy. About 100 s on an H200."),
    Part("split_7b", 7, f"The same at {LARGE_CPU} (7.06B, activation checkpointing): "
         f"`--offload-ratio auto` at 131k tokens a step (`{THROUGHPUT}`), then at 16k "
         f"(`{TOKENS_16K}`) zerofn without offload (`--contenders nooffload`, if it fits the "
         "device), full offload, and full offload with `--overlap-step`. A run whose host "
         "estimate exceeds the memory available is skipped with the figures. About 5 min."),
    Part("profile", 1, "One ZeRO-3 + bf16 + offload('cpu') step of a 1024x8 GPT (and params="
         "True): host synchronizations per step (sync debug mode) and host waits on copy "
         "events (which that mode does not see), and from a torch.profiler trace the share "
         "of device-to-host copy time overlapping compute kernels, CPU Adam, and either (the "
         "host ring brings gradients down during the step, beside the previous unit's CPU "
         "Adam; params=True lands them in backward, beside compute), and of host-to-device "
         "copy time overlapping CPU Adam. Reported, not judged."),
    Part("race", 4, "Race stress: the same comparison with every copy on the side streams and "
         "every collective held back by a ~1 ms spin (`torch.cuda._sleep`), which a missing "
         "wait turns into stale data; then once without spins under "
         "`TORCH_CUDA_SANITIZER=1`."),
    Part("compile", 1.5, "`torch.compile` with inductor (Triton kernels) over ZeRO-2 and ZeRO-3 + "
         "offload('cpu', params=True), bf16: each step's loss and gradient norm against the "
         "uncompiled run (`tests/test_cuda.py::test_inductor_compiled_models_train_as_eager_ones`)."),
    Part("nvme", 3, "`bench_offload.py --find-largest --nvme DIR`: the largest of "
         f"{', '.join(NVME_LADDER)} whose swap file fits the free disk (13.2B needs ~150 GB) "
         "and whose I/O fits the part's time at the disk's measured O_DIRECT bandwidth, "
         "1 warm-up and 2 timed steps (each reads and writes the whole swap file)."),
    Part("deepspeed", 2.5, f"DeepSpeed ZeRO-Offload (stage 2, optimizer on the CPU, bf16) on "
         f"the {COMPARE_SIZE} model (`bench_offload.py --contenders deepspeed`), when DeepSpeed "
         "is installed or its wheels are carried along (`--deepspeed-wheel`, or `wheels/` as "
         "`tools/deepspeed_wheels.sh` fills it)."),
    Part("split_ds", 4, f"DeepSpeed at the split part's model and batch, ZeRO-3 with "
         f"`offload_optimizer.ratio` {', '.join(map(str, DS_RATIOS))} (`--contenders deepspeed "
         "--ds-ratio R`; its first run compiles DeepSpeed's CPU Adam where the deepspeed part "
         "has not): its best ratio, against the split part's faster zerofn run. \"not "
         "installed\" without DeepSpeed. About 3 min with DeepSpeed."),
]
PART_NAMES = [p.name for p in PARTS]
LIMIT = {p.name: 60 * p.minutes for p in PARTS}     # seconds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PART_NAMES),
                   help=f"comma-separated parts to run, in order: {', '.join(PART_NAMES)}; "
                   "'pending' stands for every part the results do not hold as passed")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="start a part only while its whole time limit fits in what is left "
                   "of SECONDS, so that a command under a time limit is never cut mid-part")
    p.add_argument("--plan", action="store_true",
                   help="write the report as 'not yet run', listing what the check runs")
    p.add_argument("--results", default=RESULTS, help="JSON the results accumulate in")
    p.add_argument("--report", default=REPORT, help="the markdown report to write")
    p.add_argument("--copy-to", metavar="DIR", help="also copy report, results and trace here")
    p.add_argument("--fresh", action="store_true", help="forget earlier results first")
    p.add_argument("--nvme-dir", default=os.path.join(ROOT, "build", "gpu_check", "nvme"),
                   help="where the NVMe part puts its swap file")
    p.add_argument("--deepspeed-wheel", help="a DeepSpeed wheel to install (offline)")
    p.add_argument("--worker", choices=("profile",), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in args.parts if s not in PART_NAMES + ["pending"]]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PART_NAMES)}")
    return args


# -- running commands --------------------------------------------------------------------
def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """``(exit status, stdout+stderr)``; a timeout is status 124 with what was printed, and
    a command that cannot start is status 127.

    The command runs in a session of its own, killed whole on a timeout: the ranks a test
    spawns would otherwise outlive it, holding the GPU's memory through the next parts."""
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **(env or {})},
                                start_new_session=True)
    except OSError as e:
        return 127, f"{cmd[0]}: {e}"
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out + f"\n(timed out after {timeout:.0f} s)"


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def pytest_result(rc: int, out: str) -> dict:
    """Pass/fail counts and the failing tests from pytest's summary."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    ok = rc == 0 and counts.get("passed", 0) > 0 and not counts.get("skipped")
    return dict(status="ok" if ok else "failed", figures=counts,
                lines=[f"pytest: {', '.join(f'{v} {k}' for k, v in counts.items()) or 'no summary'}"]
                + [f"failed: `{f}`" for f in failed],
                detail=None if ok else tail(out, 30))


def pytest(targets: list[str], timeout: float, env: dict | None = None, log: str = "") -> dict:
    """The tests' result; their whole output goes to ``LOGS/<log>.log`` where ``log`` is
    given (the report keeps only its tail)."""
    rc, out = run([sys.executable, "-m", "pytest", "-q", "-rfEs", *targets], timeout, env)
    if log:
        os.makedirs(TRACE_DIR, exist_ok=True)
        with open(os.path.join(TRACE_DIR, f"{log}.log"), "w") as f:
            f.write(out)
    return pytest_result(rc, out)


# -- parts -------------------------------------------------------------------------------
def part_build(args) -> dict:
    rc, out = run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                   "-e", "."], LIMIT["build"] / 2)
    how = "pip install -e ."
    if rc:   # e.g. site-packages not writable: build in place (tests import from the tree)
        how = "setup.py build_ext --inplace, after pip install failed"
        rc, out = run([sys.executable, "setup.py", "build_ext", "--inplace"], LIMIT["build"] / 2)
    if rc:
        return dict(status="failed", lines=["the build failed"], detail=tail(out, 30))
    rc, out = run([sys.executable, "-c", "import json, zerofn.optim as o; "
                   "print(json.dumps(o.kernel_info()))"], 120)
    if rc:
        return dict(status="failed", lines=["built, but zerofn._C does not load"],
                    detail=tail(out))
    info = json.loads(out.strip().splitlines()[-1])
    return dict(status="ok", figures=info,
                lines=[f"built by {how}",
                       f"CPU Adam kernels: {info.get('isa')} ({info.get('threads')} threads)"])


CUDA_TESTS = ["tests/test_cuda.py",
              "tests/test_offload_copies.py::test_cuda_copy_streams_train_like_blocking_copies[False]"]
SLEEPY_TEST = "tests/test_offload_copies.py::test_cuda_copy_streams_train_like_blocking_copies[True]"
COMPILE_TEST = "tests/test_cuda.py::test_inductor_compiled_models_train_as_eager_ones"


def part_tests(args) -> dict:
    return pytest(CUDA_TESTS + ["--deselect", COMPILE_TEST], LIMIT["tests"], log="tests")


def part_compile(args) -> dict:
    return pytest([COMPILE_TEST], LIMIT["compile"], log="compile")


def part_race(args) -> dict:
    start = time.perf_counter()
    held = pytest([SLEEPY_TEST], LIMIT["race"] / 2, log="race_held")
    # The sanitizer intercepts every kernel: it gets whatever the held-back run left.
    sanitized = pytest([CUDA_TESTS[1]], LIMIT["race"] - (time.perf_counter() - start) - 5,
                       {"TORCH_CUDA_SANITIZER": "1"}, log="race_sanitizer")
    ok = held["status"] == sanitized["status"] == "ok"
    return dict(status="ok" if ok else "failed",
                figures=dict(held_back=held["figures"], sanitizer=sanitized["figures"]),
                lines=["copies and collectives held back: " + "; ".join(held["lines"]),
                       "under TORCH_CUDA_SANITIZER=1: " + "; ".join(sanitized["lines"])],
                detail="\n\n".join(d for d in (held["detail"], sanitized["detail"]) if d) or None)


# (stage, optimizer, micro-batches per step, options): every option of the parity matrix
# that differs on a device, with rows not divisible by 3.
PARITY_CONFIGS = [(1, "adamw", 2, {"clip": 0.05}), (2, "adamw", 2, {"clip": 0.05}),
                  (3, "adamw", 2, {"clip": 0.05}), (3, "sgd", 1, {}),
                  (2, "adamw", 1, {"offload": {}}),
                  (3, "adamw", 2, {"offload": {"params": True}, "clip": 0.05})]


def parity_rank(rank, world, device: str, configs) -> list[tuple[float, float]]:
    """Each config trained sharded over the world's gloo group on ``device`` (every rank on
    the same GPU for cuda) and as plain PyTorch on the same device: the largest
    differences of the full params and of the optimizer state."""
    import torch

    import zerofn as zf
    from support.models import batches, make_models, make_optimizer
    from support.loops import STAGES, train_reference, train_sharded
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = []
    for stage, kind, accum, opts in configs:
        ref, model = make_models()
        ref, model = ref.to(device), model.to(device)
        ref_opt = make_optimizer(kind, ref.parameters())
        opt = make_optimizer(kind, model.parameters())
        extra = [zf.offload("cpu", **opts["offload"])] if "offload" in opts else []
        model, opt = zf.compose(*(getattr(zf, n)() for n in STAGES[stage]), *extra)(model, opt)
        data = [[(x.to(device), y.to(device)) for x, y in micro]
                for micro in batches(3, accum, world)]
        train_reference(ref, ref_opt, data, opts.get("clip"))
        train_sharded(model, opt, data, rank, world, opts.get("clip"))
        out.append(_state_errors(ref, ref_opt, *zf.get_state_dict(model, opt, full=True)))
    return out


def _state_errors(ref, ref_opt, msd, osd) -> tuple[float, float]:
    import torch
    p_err = max((msd[k].cpu().float() - v.cpu().float()).abs().max().item()
                for k, v in ref.state_dict().items())
    names = {p: n for n, p in ref.named_parameters()}
    s_err = max(((osd["state"][names[p]][k].cpu() - v.cpu()).abs().max().item()
                 for p, st in ref_opt.state.items() for k, v in st.items()
                 if torch.is_tensor(v) and v.dim()), default=0.0)
    return p_err, s_err


def parity(worlds, device: str, configs=PARITY_CONFIGS, timeout: float = 600) -> dict:
    """Each world's ranks (killed after ``timeout`` seconds) against plain PyTorch."""
    sys.path[:0] = [p for p in (TESTS, TOOLS) if p not in sys.path]
    from support.ranks import run_ranks
    figures, lines, ok = {}, [], True
    for world in worlds:
        per_rank = run_ranks(world, parity_rank, device, configs, timeout=timeout)
        worst = [tuple(map(max, zip(*errs))) for errs in zip(*per_rank)]
        for config, (p_err, s_err) in zip(configs, worst):
            good = p_err < TOL and s_err < TOL
            ok &= good
            name = f"world {world}, ZeRO-{config[0]} {config[1]} x{config[2]} " + \
                " ".join(f"{k}={v}" for k, v in config[3].items())
            figures[name] = [p_err, s_err]
            lines.append(f"{'ok' if good else 'FAILS'} {name}: params {p_err:.2e}, "
                         f"optimizer state {s_err:.2e} (tolerance {TOL:g})")
    return dict(status="ok" if ok else "failed", figures=figures, lines=lines)


def part_parity(args) -> dict:
    return parity((2, 3), "cuda", timeout=LIMIT["parity"] / 2)


def part_profile(args) -> dict:
    rc, out = run([sys.executable, os.path.abspath(__file__), "--worker", "profile",
                   "--results", args.results], LIMIT["profile"])
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
    lines.append(f"trace: `{os.path.relpath(os.path.join(TRACE_DIR, 'profile_trace.json'), ROOT)}`")
    return dict(status="ok", figures={r["name"]: r for r in runs}, lines=lines)


def bench(flags: list[str], seconds: float) -> tuple[int, str, list[str]]:
    rc, out = run([sys.executable, os.path.join(TOOLS, "bench_offload.py"), "--device", "cuda",
                   *flags], seconds)
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    return rc, out, table


def part_compare(args) -> dict:
    rc, out, table = bench(["--sizes", COMPARE_SIZE, "--steps", "5", "--warmup", "2",
                            "--timeout", str(int(LIMIT["compare"] / 2))], LIMIT["compare"])
    ratio = re.search(r"zerofn/FSDP2 = ([\d.]+)×", out)
    figures = {"ratio": float(ratio.group(1))} if ratio else {}
    figures.update(_row_figures(table, "zerofn offload"))
    fsdp2 = _row_figures(table, "FSDP2 CPUOffload")
    figures.update({f"fsdp2_{k}": v for k, v in fsdp2.items()})
    ok = rc == 0 and ratio is not None
    return dict(status="ok" if ok else "failed", figures=figures,
                lines=table + [ln for ln in out.splitlines() if "zerofn/FSDP2" in ln],
                detail=None if ok else tail(out))


def _row_figures(table: list[str], label: str) -> dict:
    """tokens/s and TFLOP/s of the first table row of ``label``."""
    for row in table:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) > 3 and cells[1] == label:
            try:
                return {"tokens_per_s": float(cells[2].replace(",", "")),
                        "tflops": float(cells[3]), "size": cells[0]}
            except ValueError:
                return {"size": cells[0], "failure": cells[2]}
    return {}


JOB = [sys.executable, "-m", "zerofn", "train", "--nproc", "1", "--steps", "200",
       "--log-every", "50", "--save-dir", os.path.join(TRACE_DIR, "job"),
       "--tensorboard", os.path.join(TRACE_DIR, "job_tb")]


def part_job(args) -> dict:
    shutil.rmtree(os.path.join(TRACE_DIR, "job"), ignore_errors=True)
    first_rc, first = run(JOB + ["--stop-at", "100"], LIMIT["job"] / 2)
    rc, out = run(JOB + ["--resume"], LIMIT["job"] / 2)
    keep = ("plan:", "step ", "first loss", "final loss")
    lines = [ln.strip() for ln in (first + out).splitlines() if ln.startswith(keep)]
    final = re.search(r"final loss ([\d.]+) after 200 steps", out)
    start = re.search(r"first loss ([\d.]+)", first)
    ok = first_rc == rc == 0 and final and start and float(final[1]) < float(start[1])
    return dict(status="ok" if ok else "failed", lines=[f"`{ln}`" for ln in lines],
                figures={"final_loss": float(final[1])} if final else {},
                detail=None if ok else tail(first + out, 30))


def part_largest(args) -> dict:
    return _largest(["--find-largest", "--sizes", LARGE_CPU, *THROUGHPUT.split()],
                    LIMIT["largest"])


def part_largest_int8(args) -> dict:
    return _largest(["--find-largest", "--sizes", ",".join(LARGE_INT8_LADDER),
                     *THROUGHPUT.split(), *INT8_STATE.split()], LIMIT["largest_int8"])


# A run of the NVMe part writes the swap file once, then each of its 3 steps reads and
# writes all of it; the rest (building the model, the first compute) takes about a minute.
NVME_PASSES, NVME_SET_UP = 7, 60


def part_nvme(args) -> dict:
    os.makedirs(args.nvme_dir, exist_ok=True)
    free = shutil.disk_usage(args.nvme_dir).free
    bandwidth = disk_bandwidth(args.nvme_dir)
    sys.path.insert(0, TOOLS)
    import bench_offload as bo
    bargs = bo.parse_args(["--device", "cuda"])
    lines = [f"{free / 2**30:.0f} GB free at the NVMe directory; O_DIRECT "
             f"{bandwidth / 1e9:.2f} GB/s (the slower of writing and reading 1 GiB)"]
    fits = []
    for size in NVME_LADDER:
        params = bo.model_config(size, bargs).params()
        need = bo.nvme_need(params, bargs)
        io = NVME_PASSES * need / bandwidth
        verdict = "does not fit the disk" if need > 0.95 * free else \
            "too slow for the part's limit" if io > LIMIT["nvme"] - NVME_SET_UP else "fits"
        lines.append(f"{size} ({params / 1e9:.2f}B): swap file {need / 2**30:.0f} GB, "
                     f"~{io:.0f} s of I/O: {verdict}")
        if verdict == "fits":
            fits.append(size)
    if not fits:
        return dict(status="failed", lines=lines + ["no size of the ladder fits"])
    result = _largest(["--find-largest", "--nvme", args.nvme_dir, "--sizes", fits[0],
                       "--warmup", "1", "--steps", "2"], LIMIT["nvme"])
    result["lines"] = lines + result["lines"]
    return result


def disk_bandwidth(directory: str, nbytes: int = 1 << 30) -> float:
    """Bytes a second of writing then reading ``nbytes`` in ``directory`` past the page
    cache (O_DIRECT, as the swap file is used, where the filesystem allows it): the slower
    of the two."""
    import mmap
    path = os.path.join(directory, "bandwidth_probe")
    chunk = mmap.mmap(-1, min(nbytes, 64 << 20))     # page-aligned, as O_DIRECT needs
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT)
    except OSError:      # (tmpfs and some overlays refuse O_DIRECT)
        fd = os.open(path, flags)
    try:
        start = time.perf_counter()
        for _ in range(nbytes // len(chunk)):
            os.write(fd, chunk)
        os.fsync(fd)
        write = time.perf_counter() - start
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        for _ in range(nbytes // len(chunk)):
            os.readv(fd, [chunk])
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        os.remove(path)
    return (nbytes // len(chunk)) * len(chunk) / max(write, read)


def _largest(flags: list[str], seconds: float) -> dict:
    rc, out, table = bench(flags + ["--timeout", str(int(seconds - 30))], seconds)
    summary = next((ln for ln in out.splitlines() if ln.startswith("largest that trained")), "")
    m = re.search(r"= ([\d.]+)([BM]) params, ([\d,]+) tokens/s, ([\d.e+-]+) TFLOP/s", summary)
    figures = {"params": float(m.group(1)) * (1e9 if m.group(2) == "B" else 1e6),
               "tokens_per_s": float(m.group(3).replace(",", "")),
               "tflops": float(m.group(4))} if m else {}
    return dict(status="ok" if m else "failed", figures=figures,
                lines=table + ([summary] if summary else []),
                detail=None if m else tail(out))


def part_deepspeed(args) -> dict:
    start = time.perf_counter()
    found = _deepspeed_available(args)
    if found is not True:
        return dict(status="skipped", lines=[found])
    r = bench_runs([("zero2", "deepspeed", [], LIMIT["deepspeed"])], COMPARE_SIZE,
                   LIMIT["deepspeed"] - (time.perf_counter() - start))["zero2"]
    if r["status"] != "ok":
        return dict(status="failed", lines=[run_line("zero2", r)])
    return dict(status="ok", figures=r,
                lines=[f"DeepSpeed {r['version']} ZeRO-Offload, {COMPARE_SIZE}: "
                       f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.3g} TFLOP/s, "
                       f"step {1e3 * r['step_s']:.0f} ms"])


def _deepspeed_available(args) -> bool | str:
    """True once ``import deepspeed`` works (installing a carried wheel offline first),
    else why not."""
    if run([sys.executable, "-c", "import deepspeed"], 300)[0] == 0:
        return True
    wheel = args.deepspeed_wheel or os.environ.get("ZEROFN_DEEPSPEED_WHEEL") or next(
        iter(sorted(glob.glob(os.path.join(ROOT, "wheels", "deepspeed-*.whl")))), None)
    if wheel is None:
        return "no DeepSpeed installed and no wheel carried along: not run"
    rc, out = run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                   os.path.dirname(os.path.abspath(wheel)), wheel], 600)
    if rc or run([sys.executable, "-c", "import deepspeed"], 300)[0]:
        return f"the carried wheel {os.path.basename(wheel)} did not install: {tail(out, 3)}"
    return True


# A bench_offload run needs its process, CUDA and the model built: no use starting one
# with less time than this left.
MIN_RUN = 20


def bench_runs(runs, size: str, seconds: float) -> dict:
    """Each of ``runs`` (key, contender, bench_offload flags, its own time limit) at
    ``size`` in its own process, all within ``seconds``: a run gets its limit or what is
    left; zerofn's runs are skipped where bench_offload's host estimate exceeds the
    memory available (the kernel would kill them partway through pinning). Each result
    keeps its command."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import bench_offload as bo
    deadline = time.perf_counter() + seconds
    out = {}
    for key, contender, flags, limit in runs:
        bargs = bo.parse_args(["--device", "cuda", "--sizes", size, "--contenders", contender,
                               *flags])
        command = f"bench_offload.py --contenders {contender} --sizes {size} {' '.join(flags)}"
        left = deadline - time.perf_counter()
        need = bo.host_need(bo.model_config(size, bargs), bargs) if contender == "zerofn" else 0
        if left < MIN_RUN:
            r = dict(status="not run", reason=f"{left:.0f} s left of the part's limit")
        elif need > bo.mem_available():
            r = dict(status="skipped", reason=f"needs ~{need / 2**30:.0f} GiB host, "
                     f"{bo.mem_available() / 2**30:.0f} GiB available")
        else:
            bargs.timeout = int(min(limit, left))
            r = bo.launch(contender, size, bargs)
        out[key] = dict(r, command=command.strip())
    return out


def run_line(key: str, r: dict) -> str:
    """One bench_offload run as a line of the report."""
    head = f"{key} (`{r['command']}`)"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r.get('reason', '')}"
    text = (f"{head}: {r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.3g} TFLOP/s, step "
            f"{1e3 * r['step_s']:.0f} ms, peak GPU {_gb(r.get('peak_device'))} GB, peak host "
            f"{_gb(r.get('peak_host'))} GB")
    if r.get("cpu_adam_s"):
        text += f", host Adam {1e3 * r['cpu_adam_s']:.0f} ms a step"
    return text + (f"; {r['placement']}" if r.get("placement") else "")


def _gb(v) -> str:
    return "—" if v is None else f"{v / 2**30:.1f}"


def _ratio(a: dict, b: dict, key: str = "tokens_per_s") -> float | None:
    """``a[key] / b[key]`` where both runs finished, else None."""
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return a[key] / b[key]


def part_split(args) -> dict:
    flags = SPLIT.split()
    runs = bench_runs([("full", "zerofn", flags + ["--adam-time"], 55),
                       ("auto", "zerofn", flags + ["--offload-ratio", "auto"], 55),
                       ("fsdp2", "fsdp2", flags, 50)], COMPARE_SIZE, LIMIT["split"] - 5)
    full = runs["full"]
    figures = dict(runs=runs, auto_vs_fsdp2=_ratio(runs["auto"], runs["fsdp2"]),
                   step_vs_adam=full["step_s"] / full["cpu_adam_s"]
                   if full.get("cpu_adam_s") else None)
    lines = [run_line(k, r) for k, r in runs.items()]
    if figures["auto_vs_fsdp2"] is not None:
        lines.append(f"ratio auto / FSDP2: {figures['auto_vs_fsdp2']:.2f}× tokens/s")
    if figures["step_vs_adam"] is not None:
        lines.append(f"full offload: the step is {figures['step_vs_adam']:.2f}× the host "
                     f"Adam's own time")
    return _bench_result(runs, figures, lines)


def _bench_result(runs: dict, figures: dict, lines: list[str], may_not_fit=()) -> dict:
    """A part of bench_offload runs: ok where every run finished, or was skipped for host
    memory (it says so), or ran out of device memory where that is a finding (the runs
    ``may_not_fit``), and one at least measured."""
    def fine(key, r):
        return r["status"] in ("ok", "skipped") or (key in may_not_fit and
                                                     r["status"] == "oom-device")
    ok = all(fine(k, r) for k, r in runs.items()) and \
        any(r["status"] == "ok" for r in runs.values())
    return dict(status="ok" if ok else "failed", figures=figures, lines=lines)


def part_split_7b(args) -> dict:
    big, tokens_16k = ["--checkpoint", "on"], TOKENS_16K.split()
    runs = bench_runs([("auto_131k", "zerofn", big + THROUGHPUT.split() +
                        ["--offload-ratio", "auto"], 180),
                       ("nooffload_16k", "nooffload", big + tokens_16k, 90),
                       ("full_16k", "zerofn", big + tokens_16k, 110),
                       ("overlap_16k", "zerofn", big + tokens_16k + ["--overlap-step"], 110)],
                      LARGE_CPU, LIMIT["split_7b"] - 5)
    auto, device = runs["auto_131k"], runs["nooffload_16k"]
    figures = dict(runs=runs, tflops_auto=auto.get("tflops"), no_offload=device["status"],
                   share_full=_ratio(runs["full_16k"], device),
                   share_overlap=_ratio(runs["overlap_16k"], device))
    lines = [run_line(k, r) for k, r in runs.items()]
    if device["status"] == "ok":
        lines += [f"16k tokens a step, share of no-offload tokens/s: full offload "
                  f"{_share(figures['share_full'])}, with overlap_step "
                  f"{_share(figures['share_overlap'])}"]
    else:
        lines += [f"no offload at 16k tokens a step did not run ({device['status']}): no "
                  "share of it to give"]
    return _bench_result(runs, figures, lines, may_not_fit=("nooffload_16k",))


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f} %"


def part_split_ds(args) -> dict:
    start = time.perf_counter()
    found = _deepspeed_available(args)
    if found is not True:
        return dict(status="skipped", lines=[found])
    runs = bench_runs([(f"ratio {r:g}", "deepspeed", SPLIT.split() + ["--ds-ratio", str(r)],
                        100) for r in DS_RATIOS], COMPARE_SIZE,
                      LIMIT["split_ds"] - 5 - (time.perf_counter() - start))
    done = {k: r for k, r in runs.items() if r["status"] == "ok"}
    best = max(done, key=lambda k: done[k]["tokens_per_s"], default=None)
    figures = dict(runs=runs, best=best,
                   best_tokens_per_s=done[best]["tokens_per_s"] if best else None)
    lines = [run_line(k, r) for k, r in runs.items()]
    if best:
        lines.append(f"DeepSpeed {done[best]['version']}'s best: {best}, "
                     f"{figures['best_tokens_per_s']:,.0f} tokens/s")
    return _bench_result(runs, figures, lines)
PART_RUNNERS = {"build": part_build, "tests": part_tests, "parity": part_parity,
                "job": part_job, "largest": part_largest, "largest_int8": part_largest_int8,
                "compare": part_compare,
                "profile": part_profile, "race": part_race, "compile": part_compile,
                "nvme": part_nvme, "deepspeed": part_deepspeed, "split": part_split,
                "split_7b": part_split_7b, "split_ds": part_split_ds}


# -- workers (their own processes: CUDA and NCCL state start fresh) ----------------------
def profile_worker(args) -> None:
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, TOOLS)
    import bench_offload as bo

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
            prof.export_chrome_trace(os.path.join(TRACE_DIR, "profile_trace.json"))
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
                d2h_overlap_compute=_covered(d2h, kernels), d2h_overlap_adam=_covered(d2h, adam),
                d2h_overlap_either=_covered(d2h, kernels + adam),
                h2d_overlap_adam=_covered(h2d, adam))


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


def _covered(spans, by) -> float:
    """The share of the union of ``spans`` that the union of ``by`` covers."""
    total = _total(spans)
    if not total:
        return math.nan
    cover = _union(by)
    inside = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in _union(spans) for cs, ce in cover)
    return inside / total


# -- results and the report ---------------------------------------------------------------
def expand_pending(names: list[str], done: dict) -> list[str]:
    """``names`` with 'pending' replaced by the parts ``done`` does not hold as passed (not
    run, failed or skipped: a fix or a carried wheel may have changed that since), in the
    parts' order, each part once."""
    pending = [p for p in PART_NAMES if done.get(p, {}).get("status") != "ok"]
    out = []
    for name in names:
        for n in (pending if name == "pending" else [name]):
            if n not in out:
                out.append(n)
    return out


def with_build(names: list[str], built=None) -> list[str]:
    """``names``, led by a build where a part needs ``zerofn._C`` and it does not load: a
    freshly copied tree has sources only, and every part but the build imports it."""
    if "build" in names or not names:
        return names
    built = _extension_loads() if built is None else built
    return names if built else ["build"] + names


def _extension_loads() -> bool:
    return run([sys.executable, "-c", "import zerofn._C"], 120)[0] == 0


def load_results(path: str, fresh: bool) -> dict:
    if fresh or not os.path.exists(path):
        return {"parts": {}}
    with open(path) as f:
        return json.load(f)


def _commit() -> str:
    """ZEROFN_COMMIT where it is set (a tree copied to a lent device machine), else the
    checked-out commit of a git repository whose top level is the project root: a copy of
    the tree inside another repository would report that one's."""
    if os.environ.get("ZEROFN_COMMIT"):   # said outright: a copied tree may carry a stale .git
        return os.environ["ZEROFN_COMMIT"]
    rc, top = run(["git", "rev-parse", "--show-toplevel"], 30)
    if rc == 0 and os.path.realpath(top.strip()) == os.path.realpath(ROOT):
        rc, out = run(["git", "rev-parse", "--short", "HEAD"], 30)
        if rc == 0:
            return out.strip()
    return "unknown"


def environment() -> dict:
    import platform

    import torch
    env = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               cpus=os.cpu_count(), host_gb=_host_gb(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               commit=_commit())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_gb=props.total_memory / 2**30)
    else:
        env.update(device="no CUDA device", device_gb=0.0)
    return env


def _host_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")) / 2**20


def goals(parts: dict) -> list[str]:
    """The issue's GPU goals against what the parts measured."""
    def fig(part, key):
        return parts.get(part, {}).get("figures", {}).get(key)

    ratio, cpu, nvme = fig("compare", "ratio"), fig("largest", "params"), fig("nvme", "params")
    int8 = fig("largest_int8", "params")
    tflops = fig("largest", "tflops") if cpu is not None and cpu >= GOALS["largest_cpu"] else None
    rows = [("offload('cpu') tokens/s / FSDP2 CPUOffloadPolicy, matched dtypes", "≥ 1.5×",
             None if ratio is None else f"{ratio:.2f}×", verdict(ratio, GOALS["ratio"])),
            ("largest trainable, fp32 Adam state on the host", "≥ 7B",
             None if cpu is None else f"{cpu / 1e9:.2f}B", verdict(cpu, GOALS["largest_cpu"])),
            ("largest trainable, int8 Adam state and bf16 masters on the host", "≥ 13B",
             None if int8 is None else f"{int8 / 1e9:.2f}B",
             verdict(int8, GOALS["largest_int8"])),
            ("largest trainable with NVMe", "≥ 13B",
             None if nvme is None else f"{nvme / 1e9:.2f}B", verdict(nvme, GOALS["largest_nvme"])),
            ("TFLOP/s (6N) at 7B", "≥ 300", None if tflops is None else f"{tflops:.0f}",
             verdict(tflops, GOALS["tflops_7b"]))] + split_goals(fig)
    return ["| goal | target | measured | verdict |", "|---|---|---|---|"] + \
        [f"| {g} | {t} | {m or '—'} | {v} |" for g, t, m, v in rows]


def verdict(value, target, at_most: bool = False) -> str:
    """Whether ``value`` meets ``target`` (at least it, or with ``at_most`` at most it)."""
    if value is None:
        return "not measured"
    return "meets" if (value <= target if at_most else value >= target) else "misses"


def split_goals(fig) -> list[tuple]:
    """The goal rows of "offload only what does not fit" (split, split_7b, split_ds)."""
    tflops, auto_fsdp2 = fig("split_7b", "tflops_auto"), fig("split", "auto_vs_fsdp2")
    step_adam, vs_ds = fig("split", "step_vs_adam"), _vs_deepspeed(fig)
    return [("TFLOP/s (6N) at 7B, 131k tokens a step, ratio='auto'", "≥ 450",
             None if tflops is None else f"{tflops:.0f}",
             verdict(tflops, GOALS["tflops_7b_auto"])),
            ("1.31B, 4096 tokens a step: ratio='auto' tokens/s / FSDP2 CPUOffloadPolicy",
             "≥ 3×", None if auto_fsdp2 is None else f"{auto_fsdp2:.2f}×",
             verdict(auto_fsdp2, GOALS["auto_vs_fsdp2"])),
            ("1.31B, 4096 tokens a step: full-offload step / the host Adam's own time",
             "≤ 1.15×", None if step_adam is None else f"{step_adam:.2f}×",
             verdict(step_adam, GOALS["step_vs_adam"], at_most=True)),
            ("7B, 16k tokens a step: tokens/s as a share of no offload's, full offload / "
             "with overlap_step", "reported", *_no_offload_share(fig)),
            ("zerofn tokens/s / DeepSpeed ZeRO-Offload at its best ratio, 1.31B", "≥ 1.3×",
             None if vs_ds is None else f"{vs_ds:.2f}×", verdict(vs_ds, GOALS["vs_deepspeed"]))]


def _no_offload_share(fig) -> tuple[str | None, str]:
    status = fig("split_7b", "no_offload")
    if status is None:
        return None, "not measured"
    if status != "ok":
        return f"no offload does not run ({status})", "reported"
    return (f"{_share(fig('split_7b', 'share_full'))} / "
            f"{_share(fig('split_7b', 'share_overlap'))}"), "reported"


def _vs_deepspeed(fig) -> float | None:
    """The split part's faster zerofn run over the split_ds part's best DeepSpeed run."""
    runs, best = fig("split", "runs") or {}, fig("split_ds", "best_tokens_per_s")
    zerofn = [r["tokens_per_s"] for k, r in runs.items() if k in ("full", "auto")
              and r.get("status") == "ok"]
    return max(zerofn) / best if zerofn and best else None


# [What NCCL does that gloo does not] One GPU runs NCCL at world 1 only: each code path that
# differs between the backends, and what covers it.
BACKEND_PATHS = [
    ("Averaging reduce-scatter", "`runtime/comm.py` `Comm.averages`: on NCCL one "
     "reduce-scatter with `ReduceOp.AVG`; on gloo an all-to-all and a sum, the caller divides",
     "NCCL at world 1 (tests, job; an average over one rank cannot show averaging); the "
     "logic on the CPU with a stand-in backend that averages (`tests/test_reduction.py::"
     "test_a_backend_that_averages_is_trusted_to`); NCCL's AVG over 2+ ranks: not at all"),
    ("HSDP's replicate all-reduce", "`runtime/grads.py` `_average_over_replicas`: `ReduceOp.AVG`"
     " on NCCL, sum then divide on gloo", "gloo on the CPU (`tests/test_hsdp.py`, 2 x 2); "
     "on NCCL: not at all (needs 2+ GPUs)"),
    ("Flat collectives", "`Comm.all_gather`/`reduce_scatter`: NCCL's own in-place "
     "`all_gather_into_tensor`/`reduce_scatter_tensor`; on gloo in-place broadcasts and an "
     "all-to-all ([Note: gloo collectives])", "NCCL at world 1 (tests, job, profile, compile, "
     "race); gloo with CUDA tensors at worlds 2 and 3 (parity, the experts test); NCCL at "
     "2+ ranks: not at all"),
    ("Waiting for a collective", "an NCCL work's `wait()` makes the current stream wait and "
     "returns; gloo's blocks the host, so the in-flight queue waits host collectives at once "
     "(comm.py's [Note: host collectives])", "NCCL at world 1 (tests: no host "
     "synchronization in forward and backward); gloo on the CPU (the whole suite)"),
    ("Side streams", "reductions (grads.py's [Note: the reduce stream]) and offload copies "
     "(copies.py) run on side streams wherever the device is CUDA, whatever the backend",
     "NCCL at world 1 (tests, race); gloo with CUDA tensors at worlds 2 and 3 (parity, the "
     "experts test)"),
    ("Object collectives", "`all_gather_object`/`broadcast_object_list` (set-up checks, "
     "checkpoints' verdicts) travel as CUDA tensors on NCCL, host tensors on gloo",
     "NCCL at world 1 (job: save and resume; tests: async checkpoint); gloo on the CPU"),
    ("Async checkpoints", "`io/checkpoint/api.py` saves in the background over a gloo twin "
     "of the model's group, so the save's collectives never share NCCL's stream with training",
     "NCCL at world 1 (tests: async checkpoint staged through one pinned buffer)"),
    ("Timeouts and asynchronous errors", "`timeout=` sets the group's timeout "
     "(`_set_pg_timeout`); on NCCL a watchdog aborts a stuck communicator, whose errors "
     "(`ncclRemoteError`, `NCCL communicator was aborted`) failures.py recognizes",
     "setting the timeout: NCCL at world 1 (job); a timeout or a dead rank: gloo on the CPU "
     "(`tests/test_failures.py`, `tests/test_elastic.py`); NCCL's watchdog and errors: not "
     "at all (a failing peer needs 2+ GPUs)"),
    ("Coalesced collectives", "none: zerofn issues one collective per unit on every backend "
     "and never uses `_coalescing_manager`", "nothing to cover"),
]


def backend_section() -> list[str]:
    return ["## What NCCL does that gloo does not", "",
            "One GPU runs NCCL at world 1 only; worlds 2 and 3 share it over gloo. Each code "
            "path that differs between the backends, and what covers it:", "",
            "| path | what differs | covered by |", "|---|---|---|"] + \
        [f"| {name} | {what} | {how} |" for name, what, how in BACKEND_PATHS] + [""]


# What each part records of where it ran: results gather over sessions, machines and commits.
RUN_KEYS = {"device": "on", "torch": "torch", "commit": "at"}


def render(results: dict) -> str:
    """docs/gpu.md: the environment, the goals, then each part run so far."""
    parts, env = results["parts"], results.get("env")
    if not parts or env is None:
        return render_plan()
    out = ["# zerofn on a GPU: `tools/gpu_check.py`", "",
           f"Run on {env['device']} ({env['device_gb']:.0f} GB), {env['cpus']} CPU cores, "
           f"{env['host_gb']:.0f} GB host memory; torch {env['torch']} (CUDA {env['cuda']}), "
           f"Python {env['python']}; zerofn {env['commit']}; last part run {env['date']}. "
           "Every figure below comes from a run of `python tools/gpu_check.py`; a part run on "
           "another device, torch or commit names it, and parts not run yet say so.", "",
           "## Goals", ""] + goals(parts) + ["", "## Parts", ""]
    for i, part in enumerate(PARTS, 1):
        r = parts.get(part.name)
        if r is None:
            out += [f"### {i}. {part.name}: not run yet", "", part.what, ""]
            continue
        where = "".join(f", {label} {r[k]}" for k, label in RUN_KEYS.items()
                        if r.get(k, env[k]) != env[k])
        out += [f"### {i}. {part.name}: {r['status']} ({r['seconds']:.0f} s{where})", "",
                part.what, ""]
        out += _blocks(r.get("lines", []))
        if r.get("detail"):
            out += ["", "```", r["detail"], "```"]
        out.append("")
    return "\n".join(out + backend_section())


def _blocks(lines: list[str]) -> list[str]:
    """A part's lines as markdown: table rows as they are, the rest as list items, with a
    blank line wherever one kind ends and the other starts."""
    out = []
    for ln in lines:
        table = ln.startswith("|")
        if out and table != out[-1].startswith("|"):
            out.append("")
        out.append(ln if table else f"- {ln}")
    return out


def render_plan() -> str:
    out = ["# zerofn on a GPU: `tools/gpu_check.py`", "",
           "**Not yet run.** zerofn has not yet run on a GPU, so this page holds no "
           "measurements. On a GPU machine with a CUDA build of torch "
           "(2.11 or later) and no package index:", "", "```bash",
           f"python tools/gpu_check.py                               # all parts (limits: "
           f"{sum(p.minutes for p in PARTS):g} min)",
           "python tools/gpu_check.py --parts build,tests,parity    # or a few at a time",
           "python tools/gpu_check.py --parts build,pending --budget 540 --copy-to OUT",
           "    # under a time limit per command: after a build, the parts not passed yet",
           "    # whose whole limit fits in 540 s; the report and results are copied to OUT",
           "    # after each part, so a command cut short still hands them back", "```", "",
           "It rewrites this page with every figure, the device, the torch version and the "
           "commit. Results accumulate in `docs/gpu_results.json`, committed with this page, so "
           "a later run on another machine goes on with the parts still pending. The parts "
           "come in the order of what a short time on a GPU should show first: that zerofn "
           "builds and trains correctly on CUDA, then the goals, then the stress and peer runs. "
           "The goals it reports against:", ""] + goals({}) + ["", "## What it runs", ""]
    for i, part in enumerate(PARTS, 1):
        out.append(f"{i}. **{part.name}** (limit {part.minutes:g} min): {part.what}")
    return "\n".join(out + [""] + backend_section())


def write_report(args, results: dict) -> None:
    if not args.plan:
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    with open(args.report, "w") as f:
        f.write(render(results) if not args.plan else render_plan())
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        for path in (args.report, args.results, os.path.join(TRACE_DIR, "profile_trace.json"),
                     *glob.glob(os.path.join(TRACE_DIR, "*.log"))):
            if os.path.exists(path):
                shutil.copy(path, args.copy_to)


def main() -> None:
    args = parse_args()
    if args.worker == "profile":
        return profile_worker(args)
    deadline = None if args.budget is None else time.perf_counter() + args.budget
    results = load_results(args.results, args.fresh)
    if args.plan:
        write_report(args, results)
        return
    results["env"] = environment()
    for name in with_build(expand_pending(args.parts, results["parts"])):
        left = math.inf if deadline is None else deadline - time.perf_counter()
        if left < LIMIT[name]:
            print(f"# {name}: not started, its limit ({LIMIT[name]:.0f} s) is more than the "
                  f"{left:.0f} s of budget left", file=sys.stderr, flush=True)
            continue
        print(f"# {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            r = PART_RUNNERS[name](args)
        except Exception as e:   # a part's own failure is a result; the next part still runs
            first = (str(e).strip().splitlines() or [""])[0]
            r = dict(status="failed", lines=[f"{type(e).__name__}: {first}"[:300]],
                     detail=tail(traceback.format_exc(), 30))
        r["seconds"] = time.perf_counter() - start
        r.update({k: results["env"][k] for k in RUN_KEYS})
        results["parts"][name] = r
        write_report(args, results)
        print(f"# {name}: {r['status']} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    print(render(results))


if __name__ == "__main__":
    main()
