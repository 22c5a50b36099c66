"""Where a rank writes its logs, and DeepSpeed's csv_monitor layout of them."""
from __future__ import annotations

import csv
import os


def writing_ranks(ranks, world: int) -> tuple[int, ...]:
    return tuple(range(world)) if ranks == "all" else ranks


def rank_dir(root: str, ranks, rank: int, world: int) -> str:
    """Where a rank writes: ``root`` when one rank writes, else ``root/rank<r>``."""
    return root if len(writing_ranks(ranks, world)) == 1 else os.path.join(root, f"rank{rank}")


class CsvSeries:
    """DeepSpeed's csv_monitor layout: one ``<tag with _ for />.csv`` per series, rows
    ``step,value`` under a header naming the tag's last part."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict = {}

    def add(self, tag: str, value: float, step: int) -> None:
        entry = self._files.get(tag)
        if entry is None:
            path = os.path.join(self.directory, tag.replace("/", "_").replace(" ", "_") + ".csv")
            f = open(path, "a", newline="")
            entry = self._files[tag] = (f, csv.writer(f))
            if f.tell() == 0:
                entry[1].writerow(["step", tag.rsplit("/", 1)[-1]])
        entry[1].writerow([step, value])

    def flush(self) -> None:
        for f, _ in self._files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files = {}
