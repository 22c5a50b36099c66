"""tools/gpu_check's CPU-exercisable parts: its arguments and both ways of running it, the
words of parts.toml and the page they render (the plan while nothing has run; figures,
failures and goal verdicts from results; the committed page from the committed results), a
failing part that does not stop the next, the overlap arithmetic of its profile, and its
parity code path at world 3 with CPU tensors."""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))   # the check is a tool: it imports from tools/
from gpu_check import (benchmarks, catalog, commands, parity, parts,  # noqa: E402
                       profiling, report, results)
from gpu_check.__main__ import main, parse_args  # noqa: E402


def test_parts_run_in_the_order_given_and_unknown_ones_are_refused(capsys):
    assert parse_args(["--parts", "parity, race"]).parts == ["parity", "race"]
    assert parse_args([]).parts == catalog.PART_NAMES
    with pytest.raises(SystemExit):
        parse_args(["--parts", "tests,speed"])
    assert "unknown part(s) speed" in capsys.readouterr().err


def test_the_plan_lists_every_part_and_measures_nothing(tmp_path):
    page = tmp_path / "gpu.md"
    main(["--plan", "--report", str(page), "--results", str(tmp_path / "r.json")])
    text = page.read_text()
    assert text.startswith("# zerofn on a GPU") and "**Not yet run.**" in text
    assert all(f"**{p.name}**" in text for p in catalog.PARTS)
    assert text.count("not measured") == len(report.goals({})) - 2 and "tokens/s |" not in text
    assert "| largest trainable, int8 Adam state and bf16 masters on the host | ≥ 13B | — | " \
           "not measured |" in text
    assert "## What NCCL does that gloo does not" in text and "| Averaging reduce-scatter |" in text
    assert not (tmp_path / "r.json").exists()     # a plan records no results


def test_the_committed_page_is_what_the_committed_results_render():
    """docs/gpu.md is written by hand nowhere: parts.toml's words and the renderer over
    docs/gpu_results.json give it, byte for byte."""
    saved = json.loads((ROOT / "docs" / "gpu_results.json").read_text())
    assert report.render(saved) == (ROOT / "docs" / "gpu.md").read_text(), \
        "docs/gpu.md is stale: python3 tools/gpu_check.py --render rewrites it"


def test_both_command_lines_run_the_package(tmp_path):
    """``python3 tools/gpu_check.py``, the documented command, and the package run as a
    folder write the same pages, in fresh interpreters from another directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pages = []
    for entry in ("tools/gpu_check.py", "tools/gpu_check"):
        page = tmp_path / f"{len(pages)}.md"
        subprocess.run([sys.executable, str(ROOT / entry), "--render", "--report", str(page),
                        "--results", str(ROOT / "docs" / "gpu_results.json")],
                       cwd=tmp_path, env=env, check=True)
        pages.append(page.read_text())
    saved = json.loads((ROOT / "docs" / "gpu_results.json").read_text())
    assert pages[0] == pages[1] == report.render(saved)
    plan = tmp_path / "plan.md"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check"), "--plan", "--report",
                    str(plan), "--results", str(tmp_path / "none.json")], cwd=tmp_path,
                   env=env, check=True)
    assert plan.read_text() == report.render_plan() and not (tmp_path / "none.json").exists()


def test_parts_toml_and_the_code_name_the_same_parts_and_goals():
    """A part or goal added on one side only would fail at a run, not here, without this."""
    assert set(parts.PART_RUNNERS) == set(catalog.PART_NAMES)
    judged = {g.key for g in catalog.GOAL_ROWS if g.target is not None}
    assert judged == set(report.MEASURED) == set(catalog.GOALS)
    assert {g.key for g in catalog.GOAL_ROWS} - judged == set(report.REPORTED)
    raw = (ROOT / "tools" / "gpu_check" / "parts.toml").read_text()
    assert all("{" + field + "}" in raw for field in catalog.PROSE_FIELDS)   # none stale


BAD_DATA = [  # (a change to parts.toml, what the error must say)
    (('name = "build"\nminutes = 1\n', 'name = "build"\n'), "part 1 lacks ['minutes']"),
    (("{large_cpu} {throughput}`", "{large_gpu} {throughput}`"), "names 'large_gpu'"),
    (('unit = "×"', 'unit = "x"', 1), "goal 1 (ratio): unit 'x' is not one of"),
    (('covered = "nothing to cover"', 'covers = "nothing"'), "backend path 9 lacks ['covered']"),
]


@pytest.mark.parametrize("change, error", BAD_DATA)
def test_a_mistake_in_parts_toml_is_named(tmp_path, change, error):
    data = tmp_path / "parts.toml"
    data.write_text(Path(catalog.DATA).read_text().replace(*change))
    with pytest.raises(ValueError) as e:
        catalog.load(str(data))
    assert str(e.value).startswith("parts.toml: ") and error in str(e.value)


def test_only_the_parity_part_reads_tests_support():
    """The package reads tests/support in parity.py alone (the parity suite's own model,
    loops and ranks), and no test file anywhere."""
    readers = {}
    for path in sorted((ROOT / "tools" / "gpu_check").glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        tests = sorted(n for n in names if n.split(".")[0] in ("support", "tests")
                       or n.split(".")[-1].startswith("test_"))
        if tests:
            readers[path.name] = tests
    assert readers == {"parity.py": ["support.loops", "support.models", "support.ranks"]}


RESULTS = {
    "env": dict(device="NVIDIA H100 80GB HBM3", device_gb=79.1, cpus=16, host_gb=125.8,
                torch="2.11.0+cu128", cuda="12.8", python="3.11.7", commit="abc1234",
                date="2026-11-23 10:00 UTC"),
    "parts": {
        "compare": dict(status="ok", seconds=201.0, figures={"ratio": 1.62},
                        lines=["| 2048x24 (1.3B) | zerofn offload | 9,000 | 70.1 |",
                               "2048x24: zerofn/FSDP2 = 1.62×, meets the 1.5× target"]),
        "largest": dict(status="ok", seconds=280.0,
                        figures={"params": 7.05e9, "tokens_per_s": 4100.0, "tflops": 173.0},
                        lines=["largest that trained: 4096x34 = 7.05B params"]),
        "largest_int8": dict(status="ok", seconds=410.0,
                             figures={"params": 11.59e9, "tokens_per_s": 2900.0, "tflops": 202.0},
                             lines=["largest that trained: 5120x36 = 11.59B params, 2,900 "
                                    "tokens/s, 202 TFLOP/s; stopped at 5120x41: oom-device (x)"]),
        "race": dict(status="failed", seconds=40.0, lines=["pytest: 1 failed"],
                     detail="AssertionError: ((3, 'adamw', {}, None), 0.25)"),
        # from an earlier session, on another machine and commit
        "parity": dict(status="ok", seconds=50.0, lines=["ok world 2"],
                       device="NVIDIA H200", torch="2.11.0+cu128", commit="0ld0ne"),
    },
}


def test_the_report_holds_the_device_each_part_and_the_goal_verdicts():
    text = report.render(RESULTS)
    assert "NVIDIA H100 80GB HBM3" in text and "torch 2.11.0+cu128" in text
    assert "| offload('cpu') tokens/s / FSDP2 CPUOffloadPolicy, matched dtypes | ≥ 1.5× | " \
           "1.62× | meets |" in text
    assert "| ≥ 7B | 7.05B | meets |" in text and "| ≥ 300 | 173 | misses |" in text
    assert "| largest trainable with NVMe | ≥ 13B | — | not measured |" in text
    assert "| largest trainable, int8 Adam state and bf16 masters on the host | ≥ 13B | " \
           "11.59B | misses |" in text
    assert "### 6. largest_int8: ok (410 s)" in text and "stopped at 5120x41" in text
    assert "### 11. race: failed (40 s)" in text and "AssertionError: ((3" in text
    assert "### 3. parity: ok (50 s, on NVIDIA H200, at 0ld0ne)" in text
    assert "### 1. build: not run yet" in text
    assert "| 2048x24 (1.3B) | zerofn offload | 9,000 | 70.1 |" in text   # tables as they are


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    def broken(args):
        raise RuntimeError("no CUDA device")

    monkeypatch.setitem(parts.PART_RUNNERS, "build", broken)
    monkeypatch.setitem(parts.PART_RUNNERS, "tests",
                        lambda args: dict(status="ok", figures={"passed": 5}, lines=["5 passed"]))
    monkeypatch.setattr(parts, "_extension_loads", lambda: True)   # (another interpreter)
    saved, page = tmp_path / "r.json", tmp_path / "gpu.md"
    main(["--parts", "build,tests", "--results", str(saved), "--report", str(page),
          "--copy-to", str(tmp_path / "out")])   # as the device sessions run it
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"r.json", "gpu.md"}
    done = json.loads(saved.read_text())["parts"]
    assert done["build"]["status"] == "failed" and "no CUDA device" in done["build"]["lines"][0]
    assert done["tests"]["status"] == "ok"
    text = page.read_text()
    assert "### 1. build: failed" in text and "### 2. tests: ok" in text
    # A later invocation adds to the results instead of starting over.
    main(["--parts", "tests", "--results", str(saved), "--report", str(page)])
    assert set(json.loads(saved.read_text())["parts"]) == {"build", "tests"}


def test_copy_overlap_is_the_covered_share_of_the_copies():
    assert profiling.covered([(0, 10)], [(5, 20)]) == 0.5
    assert profiling.covered([(0, 10), (20, 30)], [(0, 4), (2, 6), (25, 40)]) == (6 + 5) / 20
    assert math.isnan(profiling.covered([], [(0, 1)]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the profile part itself runs it there")
def test_the_profile_part_starts_its_worker_through_the_package(tmp_path):
    """The worker runs as ``python3 tools/gpu_check --worker profile``: without a GPU it
    gets as far as asking for CUDA, having imported the package, bench_offload and zerofn."""
    result = profiling.part_profile(SimpleNamespace(results=str(tmp_path / "r.json")))
    assert result["status"] == "failed", result
    assert "in profile_worker" in result["detail"] and "init_world_1" in result["detail"]


def event(name: str, start: float, end: float, gpu: bool = True):
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name="CUDA" if gpu else "CPU"),
                           time_range=SimpleNamespace(start=start, end=end))


def test_gradients_coming_down_beside_cpu_adam_count_as_overlapped():
    """The host ring copies a unit's gradients down while the previous unit's CPU Adam
    runs, not beside backward's kernels: the profile names both overlaps and their union,
    so a copy hidden behind Adam does not read as exposed."""
    events = [event("ampere_bf16_gemm", 0, 10), event("Memcpy DtoH (Device -> Pinned)", 5, 15),
              event("zerofn::cpu_adam blocks.0", 20, 30, gpu=False),
              event("Memcpy DtoH (Device -> Pinned)", 25, 35),
              event("Memcpy HtoD (Pinned -> Device)", 28, 32), event("Memset (Device)", 12, 14)]
    found = profiling.overlaps(events)
    assert (found["d2h_overlap_compute"], found["d2h_overlap_adam"],
            found["d2h_overlap_either"]) == (0.25, 0.25, 0.5)
    assert found["h2d_overlap_adam"] == 0.5 and found["d2h_ms"] == 20 / 1e3


@pytest.mark.multirank
def test_parity_at_world_3_with_cpu_tensors():
    """The GPU part runs this with CUDA tensors; rows of the parity model do not divide
    by 3."""
    configs = [(3, "adamw", 2, {"clip": 0.05}), (2, "adamw", 1, {"offload": {}})]
    result = parity.run_parity((3,), "cpu", configs)
    assert result["status"] == "ok", result["lines"]
    assert len(result["figures"]) == 2 and all(e < parity.TOL for v in result["figures"].values()
                                               for e in v)
    assert result["lines"][0].startswith("ok world 3, ZeRO-3 adamw x2 clip=0.05: params ")
    # a config without options is named without a dangling space ("sgd x1 : params" was)
    assert parity.config_name(2, (3, "sgd", 1, {})) == "world 2, ZeRO-3 sgd x1"


def test_pending_stands_for_the_parts_not_passed_yet_in_order():
    """Failed and skipped parts stay pending: a fix, or a wheel carried along, may have
    changed them since."""
    done = {"build": {"status": "ok"}, "tests": {"status": "ok"}, "compare": {"status": "ok"},
            "race": {"status": "failed"}, "deepspeed": {"status": "skipped"}}
    assert results.expand_pending(["build", "pending"], done) == \
        ["build", "parity", "job", "largest", "largest_int8", "split", "split_7b", "profile",
         "race", "compile", "nvme", "deepspeed", "split_ds", "plan", "muon"]
    passed = {n: {"status": "ok"} for n in catalog.PART_NAMES}
    assert results.expand_pending(["pending", "race"], passed) == ["race"]
    assert parse_args(["--parts", "build,pending"]).parts == ["build", "pending"]


def test_parts_on_a_tree_without_its_extension_build_it_first():
    """A freshly copied tree has no zerofn._C: profile, race and compile failed for want
    of it when run without the build."""
    assert parts.with_build(["profile", "race"], built=False) == ["build", "profile", "race"]
    assert parts.with_build(["profile", "race"], built=True) == ["profile", "race"]
    assert parts.with_build(["build", "tests"], built=False) == ["build", "tests"]
    assert parts.with_build([], built=False) == []


def test_the_commit_is_the_projects_own_not_an_enclosing_repositorys(tmp_path, monkeypatch):
    outer = tmp_path / "outer"
    (outer / "project").mkdir(parents=True)
    commands.run(["git", "init", "-q", str(outer)], 30)
    commands.run(["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t",
                  "commit", "-q", "--allow-empty", "-m", "outer"], 30)
    monkeypatch.delenv("ZEROFN_COMMIT", raising=False)
    assert results.commit(str(outer / "project")) == "unknown"
    assert results.commit(str(outer)) != "unknown"     # the project's own repository
    monkeypatch.setenv("ZEROFN_COMMIT", "f00d123")  # said outright, it wins over any .git
    assert results.commit(str(outer)) == "f00d123"


def test_the_nvme_probe_measures_the_disk(tmp_path):
    assert benchmarks.disk_bandwidth(str(tmp_path), 8 << 20) > 0
    assert os.listdir(tmp_path) == []          # the probe's file is gone


def test_a_budget_starts_only_the_parts_whose_whole_limit_fits(tmp_path, monkeypatch):
    ran = []
    for name in catalog.PART_NAMES:
        monkeypatch.setitem(parts.PART_RUNNERS, name, lambda args, name=name: (
            ran.append(name), dict(status="ok", lines=[]))[1])
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps({"parts": {"tests": {"status": "ok", "seconds": 1.0}}}))
    budget = catalog.LIMIT["largest"] - 1   # the parts take no time here: those of 3 min
    main(["--parts", "build,pending", "--budget", str(budget), "--results", str(saved),
          "--report", str(tmp_path / "gpu.md")])
    assert ran == ["build", "parity", "job", "compare", "split", "profile", "compile",
                   "deepspeed"]
    done = json.loads(saved.read_text())["parts"]  # largest(_int8), split_7b, race, nvme,
    # split_ds do not fit
    assert set(done) == {"tests"} | set(ran)
    env = results.environment()
    assert all(done["parity"][k] == env[k] for k in results.RUN_KEYS)


def test_a_timed_out_command_takes_its_children_with_it(tmp_path):
    """The ranks a timed-out test spawned must not outlive it (they would hold the GPU)."""
    pid_file = tmp_path / "child"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    rc, out = commands.run(["bash", "-c", script], timeout=2)
    assert rc == 124 and "timed out" in out
    stat = f"/proc/{int(pid_file.read_text())}/stat"
    for _ in range(50):
        if not os.path.exists(stat) or open(stat).read().split()[2] == "Z":   # gone or dead
            return
        time.sleep(0.1)
    raise AssertionError("the command's child outlived its timeout")


def test_a_command_that_cannot_start_is_a_result_not_a_crash():
    rc, out = commands.run(["/nonexistent/git", "rev-parse"], timeout=5)
    assert rc == 127 and "nonexistent" in out


def test_the_cpu_adam_spans_are_found_by_their_unit_labels():
    """timing.label names each span ``zerofn::cpu_adam <unit>``: an exact-name match found
    none, and the H2D-over-Adam overlap always read 0 %."""

    from torch.profiler import ProfilerActivity, profile

    from zerofn.runtime.timing import label
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with label("cpu_adam", "blocks.0"):
            time.sleep(0.01)
    adam = next(e for e in prof.events() if e.name.startswith("zerofn::cpu_adam"))
    start, end = adam.time_range.start, adam.time_range.end
    copy = SimpleNamespace(name="Memcpy HtoD (Pinned -> Device)",
                           device_type=SimpleNamespace(name="CUDA"),
                           time_range=SimpleNamespace(start=start, end=2 * end - start))
    assert profiling.overlaps([*prof.events(), copy])["h2d_overlap_adam"] == pytest.approx(0.5)


def test_the_int8_part_climbs_to_13b_with_low_precision_host_state(monkeypatch):
    """largest_int8 runs bench_offload's ladder with int8 moments and bf16 masters at the
    fp32 part's 131k tokens a step, within its limit; the ladder's top fits a 126 GB host
    by bench_offload's own estimate (fp32 state would not); the summary becomes figures."""
    import bench_offload as bo
    seen = []
    summary = ("largest that trained: 5120x41 = 13.16B params, 2,500 tokens/s, 197 TFLOP/s; "
               "the ladder ended without a failure (add larger --sizes to go on)")
    monkeypatch.setattr(benchmarks, "bench", lambda flags, seconds: (
        seen.append((flags, seconds)), (0, summary, ["| 5120x41 (13.16B) | zerofn offload |"]))[1])
    result = parts.PART_RUNNERS["largest_int8"](None)
    flags, seconds = seen[0]
    assert seconds == catalog.LIMIT["largest_int8"] and "--timeout" in flags
    text = " ".join(flags)
    assert "--state-dtype int8 --master-dtype bf16" in text and catalog.THROUGHPUT in text
    sizes = flags[flags.index("--sizes") + 1].split(",")
    assert sizes[-1] == "5120x41"
    assert sizes == sorted(sizes, key=lambda size: [int(v) for v in size.split("x")])
    assert result["status"] == "ok" and result["figures"] == {
        "params": 13.16e9, "tokens_per_s": 2500.0, "tflops": 197.0}
    args = bo.parse_args(["--device", "cuda", *flags[:flags.index("--timeout")]])
    assert (args.state_dtype, args.master_dtype, args.batch * args.accum) == ("int8", "bf16", 128)
    top = bo.model_config("5120x41", args)
    assert top.params() > catalog.GOALS["largest_int8"]
    assert bo.host_need(top, args) < 126 * 2**30 < bo.host_need(top, bo.parse_args(
        ["--device", "cuda", "--find-largest"]))
    assert "largest_int8" in results.expand_pending(["pending"], {})


@pytest.fixture
def launches(monkeypatch):
    """bench_offload's launch replaced: each call recorded as (contender, size, its parsed
    flags), answered from ``answers`` by (contender, ratio, overlap_step, ds_ratio) (a
    finished run by default), taking all of its timeout on the part's clock (the worst
    case the part's limit must hold)."""
    import bench_offload as bo
    calls, answers, clock = [], {}, [0.0]

    def launch(contender, size, args):
        calls.append((contender, size, args))
        clock[0] += args.timeout
        answer = answers.get((contender, args.offload_ratio, args.overlap_step, args.ds_ratio),
                             {})
        return answer if answer.get("status", "ok") != "ok" else dict(FINISHED, **answer)

    monkeypatch.setattr(bo, "launch", launch)
    monkeypatch.setattr(bo, "mem_available", lambda: 1 << 50)
    monkeypatch.setattr(benchmarks, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return calls, answers


FINISHED = dict(status="ok", params=1.31e9, step_s=0.5, tokens_per_s=8192.0, tflops=64.0,
                loss_first=11.25,
                loss_last=11.19, peak_host=20 << 30, peak_device=12 << 30)


def tokens(args) -> int:
    return args.batch * args.accum * args.context


def test_the_split_part_compares_full_auto_and_fsdp2_at_4096_tokens(launches):
    calls, answers = launches
    answers[("zerofn", 1.0, False, None)] = dict(tokens_per_s=8000.0, cpu_adam_s=0.45,
                                                 placement=None)
    answers[("zerofn", "auto", False, None)] = dict(
        tokens_per_s=21000.0, placement="ratio auto: ...; 20 of 25 units moved ...")
    answers[("fsdp2", 1.0, False, None)] = dict(tokens_per_s=6000.0)
    result = parts.PART_RUNNERS["split"](None)
    assert [(c, s) for c, s, _ in calls] == [("zerofn", catalog.COMPARE_SIZE)] * 2 + \
        [("fsdp2", catalog.COMPARE_SIZE)]
    full, auto, fsdp2 = (a for _, _, a in calls)
    assert full.adam_time and auto.offload_ratio == "auto" and not fsdp2.adam_time
    assert {tokens(a) for a in (full, auto, fsdp2)} == {4096}
    assert all(a.warmup == 2 for a in (full, auto, fsdp2))
    assert sum(a.timeout for a in (full, auto, fsdp2)) <= catalog.LIMIT["split"]   # worst case
    figures = result["figures"]
    assert result["status"] == "ok" and figures["auto_vs_fsdp2"] == 3.5
    assert figures["step_vs_adam"] == pytest.approx(0.5 / 0.45)
    assert "--offload-ratio auto" in " ".join(result["lines"]) and "20 of 25 units" in \
        result["lines"][1]
    text = "\n".join(report.goals({"split": result}))
    assert "/ FSDP2 CPUOffloadPolicy | ≥ 3× | 3.50× | meets |" in text
    assert "the host Adam's own time | ≤ 1.15× | 1.11× | meets |" in text


def test_the_7b_part_runs_auto_at_131k_and_three_runs_at_16k_in_its_limit(launches):
    calls, answers = launches
    answers[("nooffload", 1.0, False, None)] = dict(status="oom-device", reason="CUDA OOM")
    answers[("zerofn", "auto", False, None)] = dict(tokens_per_s=11000.0, tflops=466.0)
    result = parts.PART_RUNNERS["split_7b"](None)
    assert [c for c, _, _ in calls] == ["zerofn", "nooffload", "zerofn", "zerofn"]
    assert {s for _, s, _ in calls} == {catalog.LARGE_CPU}
    auto, device, full, overlap = (a for _, _, a in calls)
    assert auto.offload_ratio == "auto" and tokens(auto) == 131072
    assert {tokens(a) for a in (device, full, overlap)} == {16384}
    assert overlap.overlap_step and not full.overlap_step and full.offload_ratio == 1.0
    assert all(a.checkpoint == "on" for _, _, a in calls)
    assert sum(a.timeout for _, _, a in calls) <= catalog.LIMIT["split_7b"]   # worst case
    # no offload not fitting the device is a finding, not a failure
    assert result["status"] == "ok" and result["figures"]["no_offload"] == "oom-device"
    text = "\n".join(report.goals({"split_7b": result}))
    assert "ratio='auto' | ≥ 450 | 466 | meets |" in text
    assert "| reported | no offload does not run (oom-device) | reported |" in text


def test_runs_past_the_parts_limit_are_not_started(launches):
    calls, _ = launches
    runs = benchmarks.bench_runs([("a", "zerofn", [], 100), ("b", "fsdp2", [], 100)], "64x2",
                                 benchmarks.MIN_RUN - 1)
    assert calls == [] and {r["status"] for r in runs.values()} == {"not run"}
    result = benchmarks.bench_result(runs, {}, [])
    assert result["status"] == "failed"


def test_a_zerofn_run_the_host_cannot_hold_is_skipped_with_the_figures(launches, monkeypatch):
    import bench_offload as bo
    calls, _ = launches
    monkeypatch.setattr(bo, "mem_available", lambda: 1 << 30)
    runs = benchmarks.bench_runs([("big", "zerofn", ["--offload-ratio", "auto"], 100)],
                                 catalog.LARGE_CPU, 300)
    assert calls == [] and runs["big"]["status"] == "skipped"
    assert "GiB host, 1 GiB available" in runs["big"]["reason"]


def test_deepspeed_sweeps_its_ratio_and_its_best_meets_zerofn(launches, monkeypatch):
    calls, answers = launches
    monkeypatch.setattr(benchmarks, "deepspeed_available",
                        lambda args: "no DeepSpeed installed and no wheel carried along")
    skipped = parts.PART_RUNNERS["split_ds"](None)
    assert skipped["status"] == "skipped" and "installed" in skipped["lines"][0] and not calls
    monkeypatch.setattr(benchmarks, "deepspeed_available", lambda args: True)
    for r, tok in zip(catalog.DS_RATIOS, (5000.0, 6000.0, 4000.0)):
        answers[("deepspeed", 1.0, False, r)] = dict(tokens_per_s=tok, version="0.19.8")
    result = parts.PART_RUNNERS["split_ds"](None)
    assert [a.ds_ratio for _, _, a in calls] == list(catalog.DS_RATIOS)
    assert {tokens(a) for _, _, a in calls} == {4096}
    assert result["figures"]["best"] == "ratio 0.6" and "best: ratio 0.6" in result["lines"][-1]
    split = {"figures": {"runs": {"full": dict(status="ok", tokens_per_s=7000.0),
                                  "auto": dict(status="ok", tokens_per_s=9000.0)}}}
    text = "\n".join(report.goals({"split": split, "split_ds": result}))
    assert "at its best ratio, 1.31B | ≥ 1.3× | 1.50× | meets |" in text


def test_the_plan_part_reads_the_records_and_predicts_the_runs_they_were():
    """The plan part's inputs on a CPU: the committed records' zerofn rows (GiB and ms as
    the tables print them) and a prediction of the candidate a record ran."""
    from gpu_check import planning
    with open(ROOT / "docs" / "gpu_results.json") as f:
        recorded = json.load(f)["parts"]
    got = planning.measured(recorded["largest"], catalog.LARGE_CPU)
    assert got == pytest.approx(dict(gpu=43.51 * 2**30, host=106.63 * 2**30, step=14.5329))
    assert planning.measured(recorded["largest"], "1x1") is None
    pred = planning.predict(str(ROOT / "docs" / "plan_probe.json"), "256x2", 2, True)
    assert pred["gpu"] > 0 and pred["host"] > 0 and pred["step"] > 0


def test_the_muon_part_runs_its_bench_at_a_tiny_size_on_the_cpu():
    """The muon part's command and parsing, through bench_muon.py's offload mode (ZeRO-3 +
    bf16 + offload('cpu'), Muon + AdamW then AdamW alone) at a tiny size on the CPU; a run
    that fails is a failed part with the output's tail."""
    from gpu_check import muon
    r = muon.muon_run("cpu", "64x2", ["--steps", "3"], 300)
    assert r["status"] == "ok", r
    f = r["figures"]
    assert f["muon_step_s"] > 0 and f["adamw_step_s"] > 0, f
    # the ratio is of the unrounded times: within what the printed 4 decimals of each allow
    m, a, half = f["muon_step_s"], f["adamw_step_s"], 5e-5
    assert (m - half) / (a + half) - 0.005 <= f["muon_vs_adamw"] <= (m + half) / (a - half) + 0.005, f
    assert "64x2" in r["lines"][0] and "Muon/AdamW" in r["lines"][0]
    bad = muon.muon_run("cpu", "64by2", [], 300)
    assert bad["status"] == "failed" and "64by2" in bad["detail"], bad
