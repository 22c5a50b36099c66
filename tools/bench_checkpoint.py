"""What checksums and the safe readers cost: save and load times, with and without them.

    OMP_NUM_THREADS=1 python tools/bench_checkpoint.py --params 333e6 --tensors 200
    OMP_NUM_THREADS=1 python tools/bench_checkpoint.py --params 426e3 --tensors 52

A state shaped like a model of ``--params`` fp32 parameters in ``--tensors`` tensors with
AdamW's two moments (3 x params values, and the optimizer's hyperparameters as DCP bytes
entries) is saved and loaded on one process through DCP, each way ``--repeats`` times,
the order rotating each time, and the median of each is printed:

- save: torch's ``FileSystemWriter`` against zerofn's ``ChecksumWriter`` (every file
  summed as it is written, ``checksums.json`` beside ``.metadata``, the data in files of
  256 MiB at most), and against ``ChecksumWriter`` writing one file, as torch's does; all
  fsync, and each writes into an empty directory.
- load, all of the same files: torch's ``FileSystemReader`` and ``DefaultLoadPlanner``
  (plain pickles) against what ``zerofn.load_checkpoint`` runs before and during DCP's
  load, without the collectives: ``SafeReader.read_metadata`` (.metadata summed,
  restricted unpickler), ``preflight`` (this process's files summed, every entry's pickle
  scanned) and ``dcp.load`` through ``SafeReader`` and ``SafePlanner``; once with
  ``checksums.json`` moved aside (the safe readers alone), once with it.

The files are read back from the page cache where it holds them, so the load ratios are
near the most the readers add: from a cold disk the reads weigh more. The CRC-32 of the
files, summed on their own, is printed too: what the checksums add at most, on one core.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from zerofn.io.checkpoint import checksums
from zerofn.io.checkpoint.reader import SafePlanner, SafeReader, preflight


def state(params: int, tensors: int, fill: bool) -> dict:
    """``{"model": ..., "optim": ...}`` of ``params`` values in ``tensors`` tensors, random
    (``fill``) or empty, to load into."""
    sizes = [params // tensors + (i < params % tensors) for i in range(tensors)]
    make = (lambda n: torch.randn(n)) if fill else (lambda n: torch.empty(n))
    model = {f"layer{i}.weight": make(n) for i, n in enumerate(sizes)}
    moments = {name: {"exp_avg": make(t.numel()), "exp_avg_sq": make(t.numel()),
                      "step": torch.tensor(10.0)} for name, t in model.items()}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "params": list(model)}
    return {"model": model, "optim": {"state": moments, "param_groups": [group]}}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save(writer, source: dict) -> None:
    dcp.save(source, storage_writer=writer, no_dist=True)


def load_plain(ckpt: str, target: dict) -> None:
    dcp.load(target, storage_reader=FileSystemReader(ckpt), no_dist=True)


def load_safe(ckpt: str, target: dict) -> None:
    reader = SafeReader(ckpt)
    problems = preflight(reader, reader.read_metadata(), target, coordinator=True)
    if problems:
        raise ValueError("; ".join(problems))
    dcp.load(target, storage_reader=reader, planner=SafePlanner(), no_dist=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=426e3)
    parser.add_argument("--tensors", type=int, default=52)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    params = int(args.params)
    source, target = state(params, args.tensors, True), state(params, args.tensors, False)
    root = tempfile.mkdtemp(dir=args.dir)
    plain, summed, single = (os.path.join(root, n) for n in ("plain", "summed", "single"))
    sums, aside = os.path.join(summed, checksums.SUMS), os.path.join(root, checksums.SUMS)
    saves = [("save, torch's writer", lambda: save(FileSystemWriter(plain), source), plain),
             ("save, with checksums",
              lambda: save(checksums.ChecksumWriter(summed), source), summed),
             ("save, with checksums, one file", lambda: save(
                 checksums.ChecksumWriter(single, file_bytes=1 << 62), source), single)]
    loads = [("load, torch's reader", lambda: load_plain(summed, target), None),
             ("load, safe reader", lambda: load_safe(summed, target), (sums, aside)),
             ("load, safe reader and checksums", lambda: load_safe(summed, target), None)]
    times: dict[str, list[float]] = {}
    try:
        for r in range(args.repeats):
            for name, fn, path in saves[r % 3:] + saves[:r % 3]:
                shutil.rmtree(path, ignore_errors=True)
                times.setdefault(name, []).append(timed(fn))
                if path == summed:
                    crc = timed(lambda: [checksums.file_sum(os.path.join(summed, n))
                                         for n in os.listdir(summed)])
                    times.setdefault("CRC-32 of the files alone", []).append(crc)
            shutil.rmtree(plain, ignore_errors=True)
            shutil.rmtree(single, ignore_errors=True)
            for name, fn, moved in loads[r % 3:] + loads[:r % 3]:
                if moved:
                    os.replace(*moved)
                times.setdefault(name, []).append(timed(fn))
                if moved:
                    os.replace(*reversed(moved))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = sum(t.numel() * 4 for t in source["model"].values()) * 3 / 1e9
    print(f"{params:,} parameters in {args.tensors} tensors with AdamW's moments: "
          f"{3 * params:,} fp32 values, {gb:.3g} GB; median of {args.repeats}")
    median = {k: statistics.median(v) for k, v in times.items()}
    for name, seconds in median.items():
        base = median["load, torch's reader" if name.startswith("load") else
                      "save, torch's writer"]
        print(f"  {name:33s} {seconds:8.3f} s   x{seconds / base:.3f}")


if __name__ == "__main__":
    main()
