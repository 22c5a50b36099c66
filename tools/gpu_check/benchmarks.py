"""The parts that run ``tools/bench_offload.py``: zerofn against FSDP2 and DeepSpeed, the
largest model that trains (host, int8 state, NVMe), and offloading only what does not fit.

bench_offload is a sibling tool, imported where a part needs it: tools/ is on sys.path
wherever this package is, since that is where it is found."""
from __future__ import annotations

import glob
import os
import re
import shutil
import sys
import time

from .catalog import (COMPARE_SIZE, DS_RATIOS, INT8_STATE, LARGE_CPU, LARGE_INT8_LADDER,
                      LIMIT, NVME_LADDER, SPLIT, THROUGHPUT, TOKENS_16K)
from .commands import run, tail
from .paths import ROOT, TOOLS
from .report import share

# A bench_offload run needs its process, CUDA and the model built: no use starting one
# with less time than this left.
MIN_RUN = 20
# A run of the NVMe part writes the swap file once, then each of its 3 steps reads and
# writes all of it; the rest (building the model, the first compute) takes about a minute.
NVME_PASSES, NVME_SET_UP = 7, 60


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


def part_largest(args) -> dict:
    return _largest(["--find-largest", "--sizes", LARGE_CPU, *THROUGHPUT.split()],
                    LIMIT["largest"])


def part_largest_int8(args) -> dict:
    return _largest(["--find-largest", "--sizes", ",".join(LARGE_INT8_LADDER),
                     *THROUGHPUT.split(), *INT8_STATE.split()], LIMIT["largest_int8"])


def part_nvme(args) -> dict:
    import bench_offload as bo
    os.makedirs(args.nvme_dir, exist_ok=True)
    free = shutil.disk_usage(args.nvme_dir).free
    bandwidth = disk_bandwidth(args.nvme_dir)
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
    found = deepspeed_available(args)
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


def deepspeed_available(args) -> bool | str:
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


def bench_runs(runs, size: str, seconds: float) -> dict:
    """Each of ``runs`` (key, contender, bench_offload flags, its own time limit) at
    ``size`` in its own process, all within ``seconds``: a run gets its limit or what is
    left; zerofn's runs are skipped where bench_offload's host estimate exceeds the
    memory available (the kernel would kill them partway through pinning). Each result
    keeps its command."""
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


def bench_result(runs: dict, figures: dict, lines: list[str], may_not_fit=()) -> dict:
    """A part of bench_offload runs: ok where every run finished, or was skipped for host
    memory (it says so), or ran out of device memory where that is a finding (the runs
    ``may_not_fit``), and one at least measured."""
    def fine(key, r):
        return r["status"] in ("ok", "skipped") or (key in may_not_fit and
                                                     r["status"] == "oom-device")
    ok = all(fine(k, r) for k, r in runs.items()) and \
        any(r["status"] == "ok" for r in runs.values())
    return dict(status="ok" if ok else "failed", figures=figures, lines=lines)


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
    return bench_result(runs, figures, lines)


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
                  f"{share(figures['share_full'])}, with overlap_step "
                  f"{share(figures['share_overlap'])}"]
    else:
        lines += [f"no offload at 16k tokens a step did not run ({device['status']}): no "
                  "share of it to give"]
    return bench_result(runs, figures, lines, may_not_fit=("nooffload_16k",))


def part_split_ds(args) -> dict:
    start = time.perf_counter()
    found = deepspeed_available(args)
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
    return bench_result(runs, figures, lines)
