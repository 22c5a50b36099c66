"""tools/bench_offload.py runs for real on CPU: the comparison prints a table with a zerofn
row that trained (positive tokens/s, finite losses), and --find-largest stops where it
should, both at its own host-RAM check and at a real allocation failure; --state-dtype and
--master-dtype reach offload("cpu", ...) and the host estimate. Behaviour only: no timing
is asserted."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "bench_offload.py"


def run(*flags: str, timeout: float = 120, preexec_fn=None, code: int = 0) -> str:
    """The script's output, its exit status asserted: ``code`` 1 where nothing trained."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *flags],
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)
    assert done.returncode == code, done.stdout + done.stderr[-4000:]
    return done.stdout


def rows(out: str) -> dict[tuple[str, str], list[str]]:
    """Table rows by (size, contender), as lists of cell texts."""
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"(\d+x\d+) \(", cells[0]) if line.startswith("| ") else None
        if m:
            found[(m.group(1), cells[1])] = cells
    return found


def assert_trained(cells: list[str]) -> None:
    tokens = float(cells[2].replace(",", ""))
    assert tokens > 0, cells
    first, last = (float(v) for v in cells[6].split("→"))
    assert math.isfinite(first) and math.isfinite(last), cells
    # Random tokens over a 256-word vocabulary: the loss starts near ln(256).
    assert abs(first - math.log(256)) < 0.5, cells


def test_compare_prints_a_zerofn_row():
    # Two micro-batches a step: the last reduces, the first runs under no_sync.
    out = run("--sizes", "64x2", "--steps", "2", "--warmup", "1", "--accum", "2")
    assert "2x2x32 tokens/step" in out
    table = rows(out)
    assert_trained(table[("64x2", "zerofn offload")])
    fsdp2 = table[("64x2", "FSDP2 CPUOffload")]
    if fsdp2[2][0].isdigit():   # the peer ran: same seed and data, so the same first loss
        assert_trained(fsdp2)
        assert fsdp2[6].split("→")[0] == table[("64x2", "zerofn offload")][6].split("→")[0]
        assert "zerofn/FSDP2 =" in out
    else:                       # the peer may be unsupported here, but then it says why
        assert ":" in fsdp2[2], fsdp2
    assert "6*N*tokens/s" in out


def load_script():
    spec = importlib.util.spec_from_file_location("bench_offload", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow(reason="covered in every run by test_bench_offload.py::"
                        "test_low_precision_host_state_lets_a_size_fit_that_fp32_state_does_not"
                        ", the same stop with int8 state")
def test_find_largest_stops_at_the_host_limit():
    bench = load_script()
    args = bench.parse_args(["--device", "cpu", "--find-largest"])
    small, large = (bench.host_need(bench.model_config(s, args), args) for s in ("64x2", "128x2"))
    limit_gb = (small + large) / 2 / 2**30   # room for the first size only
    out = run("--find-largest", "--sizes", "64x2,128x2,128x4", "--steps", "1",
              "--host-limit-gb", f"{limit_gb:.6f}")
    table = rows(out)
    assert_trained(table[("64x2", "zerofn offload")])
    assert table[("128x2", "zerofn offload")][2].startswith("skipped"), table
    assert ("128x4", "zerofn offload") not in table   # nothing after the first failure
    assert "largest that trained: 64x2" in out


def torch_address_space() -> int:
    """Bytes of address space a process has once it imported torch: ~0.6 GB with a CPU
    wheel, ~3.2 GB with a CUDA one (torch 2.11+cu130), whose libraries are mapped whole."""
    code = ("import torch, torch.distributed; print(next(int(l.split()[1]) for l in "
            "open('/proc/self/status') if l.startswith('VmSize:')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    return int(done.stdout) * 1024


def test_find_largest_reports_a_real_allocation_failure():
    # An address-space cap of 3.4 GB beyond what importing torch takes makes the 2048x8
    # model's host arena (~4.8 GB) fail to allocate; the run must report it as a host OOM
    # instead of crashing. (A fixed 4 GB cap left a CUDA wheel no room to start at all.)
    # The ladder's climb past a size that trains is the other find-largest tests': this
    # one size, failing, leaves nothing measured, which the script's exit status says.
    limit = torch_address_space() + int(3.4 * 10**9)
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # noqa: E731
    out = run("--find-largest", "--sizes", "2048x8", "--steps", "1",
              "--host-limit-gb", "1000", preexec_fn=cap, timeout=180, code=1)
    table = rows(out)
    assert table[("2048x8", "zerofn offload")][2].startswith("oom-host"), table
    assert "no size trained; stopped at 2048x8: oom-host" in out


def test_low_precision_host_state_lets_a_size_fit_that_fp32_state_does_not():
    # --find-largest counts --state-dtype/--master-dtype in its host estimate: a limit that
    # fp32 state of 128x2 exceeds but int8 moments with bf16 masters fit, and the run at
    # that size trains with the flags forwarded to its worker; at the first size over the
    # limit the ladder stops (the last size, 128x4, is never tried).
    bench = load_script()
    lowp = bench.parse_args(["--device", "cpu", "--find-largest", "--state-dtype", "int8",
                             "--master-dtype", "bf16"])
    fp32 = bench.parse_args(["--device", "cpu", "--find-largest"])
    configs = {s: bench.model_config(s, fp32) for s in ("128x2", "256x8")}
    small, full = bench.host_need(configs["128x2"], lowp), bench.host_need(configs["128x2"], fp32)
    assert small < full
    limit = (small + full) / 2
    assert bench.host_need(configs["256x8"], lowp) > limit
    out = run("--find-largest", "--sizes", "128x2,256x8,128x4", "--steps", "1",
              "--state-dtype", "int8", "--master-dtype", "bf16",
              "--host-limit-gb", f"{limit / 2**30:.6f}")
    assert "offload('cpu', state_dtype=int8, master_dtype=bf16)" in out
    table = rows(out)
    assert_trained(table[("128x2", "zerofn offload")])
    assert table[("256x8", "zerofn offload")][2].startswith("skipped"), table
    assert ("128x4", "zerofn offload") not in table   # nothing after the first failure
    assert "largest that trained: 128x2" in out


def worker_result(*flags: str, contender: str = "zerofn") -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--worker",
                           f"{contender}:64x2", "--sizes", "64x2", "--warmup", "1", "--steps",
                           "1", *flags], capture_output=True, text=True, timeout=120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout + done.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def fp32_run() -> dict:
    """A worker's run at the default fp32 state with its host Adam timed (--adam-time): the
    fp32 case of the stored dtypes, and the whole offload a share is compared with."""
    return worker_result("--adam-time")


def test_the_stored_dtypes_reach_offload_and_its_host_bytes_are_the_estimates(fp32_run):
    """The host state a run measures (zf.model_state_bytes) is what host_need counts before
    its margin: the flags really go into offload("cpu", ...) (fp32, the default, is
    fp32_run's)."""
    import torch

    from zerofn.core.estimate import estimate_placement
    from zerofn.nanogpt import GPT
    bench = load_script()
    for state, master in (("fp32", "fp32"), ("bf16", "fp32"), ("int8", "bf16")):
        args = bench.parse_args(["--device", "cpu", "--state-dtype", state,
                                 "--master-dtype", master])
        r = fp32_run if state == "fp32" else worker_result("--state-dtype", state,
                                                           "--master-dtype", master)
        assert r["status"] == "ok" and math.isfinite(r["loss_last"]), r
        with torch.device("meta"):    # the shape, for the host ring's largest unit
            shape = GPT(bench.model_config("64x2", args))
        placed = estimate_placement(shape, 1, 3, torch.bfloat16, offload="cpu",
                                    **bench.stored_dtypes(args))
        # int8 scales are per 256 of each parameter (rounded up), the estimate's 4/256 B;
        # and parameters under 4096 elements keep fp32 moments, which a count cannot
        # know: in this tiny model (not in a large one) they are a few percent more.
        rel = 0.05 if state == "int8" else 0.01
        assert r["host_state"] == pytest.approx(placed["host"]["total"], rel=rel), (state, r)
        assert r["host_state"] >= 0.99 * placed["host"]["total"], (state, r)


def test_a_share_on_the_device_and_the_overlapped_step_reach_offload(fp32_run):
    """--offload-ratio moves optimizer state back to the (CPU) device, as the estimate
    says, and --overlap-step trains; --adam-time reads the host Adam's own time from
    zerofn's monitor."""
    full = fp32_run
    split = worker_result("--offload-ratio", "0.5", "--overlap-step")
    assert split["host_state"] < full["host_state"]
    assert full["units_on_device"] == 0 < split["units_on_device"]
    assert split["placement"] is None and split["cpu_adam_s"] is None
    assert split["loss_last"] == pytest.approx(full["loss_last"], abs=0.05)
    assert 0 < full["cpu_adam_s"] < full["step_s"]


def test_ratio_auto_places_what_the_device_budget_holds():
    """A budget far above the tiny model's needs: after the first step every unit keeps
    its optimizer state on the device, and the result says so."""
    r = worker_result("--offload-ratio", "auto", "--device-budget", str(10**12))
    assert r["status"] == "ok" and math.isfinite(r["loss_last"]), r
    moved = re.search(r"(\d+) of (\d+) units moved", r["placement"] or "")
    assert moved and int(moved[1]) == int(moved[2]) == r["units_on_device"] == 3, r


def test_the_no_offload_baseline_trains_the_same_model_on_the_device():
    r = worker_result(contender="nooffload")
    assert r["status"] == "ok" and "host_state" not in r, r
    assert abs(r["loss_first"] - math.log(256)) < 0.5


def test_the_launcher_forwards_the_offload_flags_to_its_workers():
    bench = load_script()
    given = ["--device", "cpu", "--offload-ratio", "auto", "--device-budget", "0.5",
             "--overlap-step", "--adam-time", "--ds-ratio", "0.3", "--accum", "2"]
    args = bench.parse_args(given)
    worker = bench.parse_args(bench.forwarded(args) + ["--worker", "zerofn:64x2"])
    for key in ("offload_ratio", "device_budget", "overlap_step", "adam_time", "ds_ratio",
                "accum", "state_dtype", "nvme"):
        assert getattr(worker, key) == getattr(args, key), key
    assert (args.offload_ratio, args.device_budget) == ("auto", 0.5)
    assert bench.parse_args(["--device", "cpu", "--offload-ratio", "auto", "--device-budget",
                             "4096"]).device_budget == 4096


@pytest.mark.parametrize("flags", [["--device-budget", "4096"], ["--offload-ratio", "1.5"],
                                   ["--offload-ratio", "auto", "--device-budget", "1.5"],
                                   ["--contenders", "zerofn,megatron"]])
def test_offload_flags_out_of_range_are_refused(flags):
    with pytest.raises(SystemExit):
        load_script().parse_args(["--device", "cpu", *flags])


def test_deepspeed_takes_a_ratio_at_zero3_only_and_steps_itself():
    """DeepSpeed is not installed here: its config, and the loop that drives an engine
    (backward and step per micro-batch, its own accumulation), against a stand-in."""
    from zerofn.nanogpt import GPT
    bench = load_script()
    classic = bench.deepspeed_config(bench.parse_args(["--device", "cpu", "--accum", "3"]))
    twin = bench.deepspeed_config(bench.parse_args(["--device", "cpu", "--ds-ratio", "0.6"]))
    assert classic["zero_optimization"]["stage"] == 2 and classic["gradient_accumulation_steps"] == 3
    assert "ratio" not in classic["zero_optimization"]["offload_optimizer"]
    assert twin["zero_optimization"]["stage"] == 3
    assert twin["zero_optimization"]["offload_optimizer"]["ratio"] == 0.6

    class Engine:
        def __init__(self, model):
            self.model, self.calls = model, []

        def __call__(self, x, y):
            return self.model(x, y)

        def backward(self, loss):
            self.calls.append("backward")
            loss.backward()

        def step(self):
            self.calls.append("step")

    args = bench.parse_args(["--device", "cpu", "--accum", "2", "--warmup", "0", "--steps", "1"])
    cfg = bench.model_config("64x2", args)
    engine = Engine(GPT(cfg))
    times, losses = bench.timed_steps(engine, None, cfg, args)
    assert len(times) == 1 and engine.calls == ["backward", "step"] * 2
    assert abs(losses[0] - math.log(256)) < 0.5


def test_the_swap_file_estimate_counts_the_stored_form():
    bench = load_script()
    fp32 = bench.parse_args(["--device", "cpu", "--nvme", "/tmp"])
    lowp = bench.parse_args(["--device", "cpu", "--nvme", "/tmp", "--state-dtype", "int8",
                             "--master-dtype", "bf16"])
    assert bench.nvme_need(10**9, fp32) == pytest.approx(1.01 * 12e9, abs=1)
    assert bench.nvme_need(10**9, lowp) == pytest.approx(1.01 * (2 + 2 * (1 + 4 / 256)) * 1e9,
                                                         abs=1)


