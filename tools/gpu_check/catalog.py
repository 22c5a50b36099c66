"""The parts, the goals and the backend table as parts.toml words them, and the sizes and
flags of the runs that its prose names (the code runs these same values)."""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass

from .paths import PACKAGE

DATA = os.path.join(PACKAGE, "parts.toml")

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
# Muon beside AdamW at the compare size: 8 sequences of 1024 tokens a step, the first of 4
# steps untimed.
MUON_FLAGS = "--vocab 50304 --context 1024 --steps 4"

# What a part's prose may name in braces, written as the page shows it.
PROSE_FIELDS = dict(compare_size=COMPARE_SIZE, large_cpu=LARGE_CPU, throughput=THROUGHPUT,
                    int8_ladder=",".join(LARGE_INT8_LADDER), int8_state=INT8_STATE,
                    nvme_ladder=", ".join(NVME_LADDER), split=SPLIT, tokens_16k=TOKENS_16K,
                    ds_ratios=", ".join(map(str, DS_RATIOS)), muon_flags=MUON_FLAGS)

# How a goal's figure reads, by its unit: (the scale it is divided by, decimals shown).
UNITS = {"×": (1, 2), "B": (1e9, 2), "": (1, 0)}


@dataclass(frozen=True)
class Part:
    name: str
    minutes: float      # the part's time limit
    what: str           # what it runs and shows, for the plan and the report


@dataclass(frozen=True)
class Goal:
    key: str                    # how report.py measures it
    what: str
    target: float | None        # None: reported, not judged
    at_most: bool = False
    unit: str = ""

    def target_text(self) -> str:
        if self.target is None:
            return "reported"
        scale, _ = UNITS[self.unit]
        return f"{'≤' if self.at_most else '≥'} {self.target / scale:g}{self.unit}"

    def shown(self, value: float) -> str:
        scale, digits = UNITS[self.unit]
        return f"{value / scale:.{digits}f}{self.unit}"


@dataclass(frozen=True)
class Backend:
    title: str
    intro: str
    paths: list[tuple[str, str, str]]   # (path, what differs, what covers it)


def _entry(entry: dict, where: str, required: set[str],
           optional: set[str] | frozenset[str] = frozenset()) -> dict:
    """``entry`` where it has every ``required`` key and no other than the ``optional``."""
    missing, unknown = required - set(entry), set(entry) - required - set(optional)
    if missing or unknown:
        raise ValueError(f"{where} lacks {sorted(missing)} or has unknown {sorted(unknown)}; "
                         f"it takes {sorted(required | set(optional))}")
    return entry


def _part(entry: dict, where: str) -> Part:
    _entry(entry, where, {"name", "minutes", "what"})
    try:
        what = entry["what"].format(**PROSE_FIELDS)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{where} ({entry['name']}): its text names {e}; braces name one of "
                         f"{', '.join(PROSE_FIELDS)}") from None
    return Part(entry["name"], float(entry["minutes"]), what)


def _goal(entry: dict, where: str) -> Goal:
    _entry(entry, where, {"key", "what"}, {"target", "at_most", "unit"})
    if entry.get("unit", "") not in UNITS:
        raise ValueError(f"{where} ({entry['key']}): unit {entry['unit']!r} is not one of "
                         f"{list(UNITS)}")
    return Goal(entry["key"], entry["what"], entry.get("target"), entry.get("at_most", False),
                entry.get("unit", ""))


def load(path: str = DATA) -> tuple[list[Part], list[Goal], Backend]:
    """The parts, goals and backend table of ``path``; a ValueError names what is amiss."""
    name = os.path.basename(path)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    _entry(data, name, {"part", "goal", "backend"})
    backend = _entry(data["backend"], f"{name}: backend", {"title", "intro", "path"})
    paths = [_entry(p, f"{name}: backend path {i}", {"path", "differs", "covered"})
             for i, p in enumerate(backend["path"], 1)]
    return ([_part(p, f"{name}: part {i}") for i, p in enumerate(data["part"], 1)],
            [_goal(g, f"{name}: goal {i}") for i, g in enumerate(data["goal"], 1)],
            Backend(backend["title"], backend["intro"],
                    [(p["path"], p["differs"], p["covered"]) for p in paths]))


PARTS, GOAL_ROWS, BACKEND = load()
PART_NAMES = [p.name for p in PARTS]
LIMIT = {p.name: 60 * p.minutes for p in PARTS}     # seconds
GOALS = {g.key: g.target for g in GOAL_ROWS if g.target is not None}
