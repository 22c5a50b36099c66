"""docs/gpu.md, rendered from the results and parts.toml: the environment, the goals and
their verdicts, each part run so far (or the plan, before any), and the backend table."""
from __future__ import annotations

from .catalog import BACKEND, GOAL_ROWS, GOALS, PARTS
from .results import RUN_KEYS


def verdict(value, target, at_most: bool = False) -> str:
    """Whether ``value`` meets ``target`` (at least it, or with ``at_most`` at most it)."""
    if value is None:
        return "not measured"
    return "meets" if (value <= target if at_most else value >= target) else "misses"


def share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f} %"


def _tflops_at_7b(fig) -> float | None:
    """The largest part's TFLOP/s, where what it trained reaches the 7B goal."""
    params = fig("largest", "params")
    return fig("largest", "tflops") if params is not None and \
        params >= GOALS["largest_cpu"] else None


def _vs_deepspeed(fig) -> float | None:
    """The split part's faster zerofn run over the split_ds part's best DeepSpeed run."""
    runs, best = fig("split", "runs") or {}, fig("split_ds", "best_tokens_per_s")
    zerofn = [r["tokens_per_s"] for k, r in runs.items() if k in ("full", "auto")
              and r.get("status") == "ok"]
    return max(zerofn) / best if zerofn and best else None


def _no_offload_share(fig) -> tuple[str | None, str]:
    status = fig("split_7b", "no_offload")
    if status is None:
        return None, "not measured"
    if status != "ok":
        return f"no offload does not run ({status})", "reported"
    return (f"{share(fig('split_7b', 'share_full'))} / "
            f"{share(fig('split_7b', 'share_overlap'))}"), "reported"


# Each judged goal of parts.toml, by its key: its figure from the parts' (None: not measured).
MEASURED = {
    "ratio": lambda fig: fig("compare", "ratio"),
    "largest_cpu": lambda fig: fig("largest", "params"),
    "largest_int8": lambda fig: fig("largest_int8", "params"),
    "largest_nvme": lambda fig: fig("nvme", "params"),
    "tflops_7b": _tflops_at_7b,
    "tflops_7b_auto": lambda fig: fig("split_7b", "tflops_auto"),
    "auto_vs_fsdp2": lambda fig: fig("split", "auto_vs_fsdp2"),
    "step_vs_adam": lambda fig: fig("split", "step_vs_adam"),
    "vs_deepspeed": _vs_deepspeed,
}
# Each reported goal, by its key: (what was measured, "reported" or "not measured").
REPORTED = {"no_offload_share": _no_offload_share}


def goals(parts: dict) -> list[str]:
    """The issue's GPU goals against what the parts measured, as a markdown table."""
    def fig(part, key):
        return parts.get(part, {}).get("figures", {}).get(key)

    rows = []
    for goal in GOAL_ROWS:
        if goal.target is None:
            measured, said = REPORTED[goal.key](fig)
        else:
            value = MEASURED[goal.key](fig)
            measured = None if value is None else goal.shown(value)
            said = verdict(value, goal.target, goal.at_most)
        rows.append(f"| {goal.what} | {goal.target_text()} | {measured or '—'} | {said} |")
    return ["| goal | target | measured | verdict |", "|---|---|---|---|"] + rows


def backend_section() -> list[str]:
    return [f"## {BACKEND.title}", "", BACKEND.intro, "",
            "| path | what differs | covered by |", "|---|---|---|"] + \
        [f"| {name} | {what} | {how} |" for name, what, how in BACKEND.paths] + [""]


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
