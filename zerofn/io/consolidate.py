"""Convert between a sharded checkpoint and one full state dict file, on one process.

    python -m zerofn.consolidate to-full CKPT OUT.safetensors [--dtype bf16]
    python -m zerofn.consolidate to-full CKPT OUT.pt
    python -m zerofn.consolidate to-full CKPT OUT.ckpt --lightning
    python -m zerofn.consolidate to-dcp FULL.safetensors OUT_DIR

``to-full`` reads the model weights of a zerofn or FSDP2 checkpoint (a checkpoint root,
whose ``latest`` is read, or one checkpoint directory), saved at any world size, and writes
``{fqn: full tensor}`` in fp32 (or bf16): ``model.load_state_dict(file)`` takes it as is.
``to-dcp`` writes such a file back as a checkpoint directory that
``zerofn.checkpoint.load_checkpoint(OUT_DIR, model)`` loads at any world size and stage
(model only: the file holds no optimizer state). ``--lightning`` writes what Lightning's
``LightningModule.load_from_checkpoint`` reads from a checkpoint that zerofn's Lightning
strategy saved: ``{"state_dict": weights}`` with Lightning's own entries of the checkpoint
(epoch, global step, hyper-parameters), as ``Trainer.save_checkpoint(weights_only=True)``
writes them.

No process group is needed: DCP reads every shard from disk. The whole model is held in
memory once, as for any full state dict. Both read safely, as ``load_checkpoint`` does: the
checkpoint's files are checked against their checksums and its pickles admit only what
checkpoints hold (a ``.pt`` file only tensors), unless ``--trusted`` (``trusted=True``)
says to read them as torch would.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import fs
from .checkpoint import pickles
from .checkpoint.checksums import ChecksumWriter
from .checkpoint.layout import resolve
from .checkpoint.reader import SafePlanner, SafeReader, preflight

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PREFIX = "model."
# The extra in which zerofn's Lightning strategy (zerofn.integrations.lightning) saves
# Lightning's own entries, and those a weights-only Lightning checkpoint leaves out.
LIGHTNING_EXTRA = "lightning"
TRAINING_ONLY = ("callbacks", "optimizer_states", "lr_schedulers")


def to_full(checkpoint, out, dtype: torch.dtype = torch.float32, *, trusted: bool = False,
            lightning: bool = False) -> dict[str, torch.Tensor]:
    """Write the checkpoint's model weights to ``out`` (.safetensors, or .pt for torch.save)
    as full tensors, floating ones in ``dtype``; return them. ``trusted``: read its
    pickles as torch would (see the module docstring). ``lightning``: as a Lightning
    checkpoint (torch.save), the weights under ``"state_dict"`` beside Lightning's entries."""
    out = fs.local_only(out, "The consolidated file")
    writer = _writer_for(out)
    if lightning and writer is not torch.save:
        raise ValueError(f"{out}: a Lightning checkpoint is a torch.save file; name it .ckpt.")
    ckpt = resolve(os.fspath(checkpoint))
    reader = SafeReader(ckpt, trusted=trusted)
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    entries = _lightning_entries(ckpt, saved, trusted) if lightning else None
    model_keys = [k for k in saved if k.startswith(PREFIX)]
    if not model_keys:
        raise ValueError(f"{ckpt} holds no model state (no '{PREFIX}*' entries).")
    not_tensors = [k for k in model_keys if not isinstance(saved[k], TensorStorageMetadata)]
    if not_tensors:
        raise ValueError(f"{ckpt}: model entries {not_tensors} are not tensors, which a "
                         "state dict file of tensors cannot hold.")
    model = {k[len(PREFIX):]: torch.empty(saved[k].size, dtype=saved[k].properties.dtype)
             for k in model_keys}
    problems = preflight(reader, metadata, {"model": model}, coordinator=True)
    if problems:
        raise ValueError(f"Cannot read checkpoint {ckpt}: " + "; ".join(problems))
    with single_process():
        dcp.load({"model": model}, storage_reader=reader, planner=SafePlanner(trusted=trusted),
                 no_dist=True)
    full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}
    writer(full if entries is None else {**entries, "state_dict": full}, out)
    return full


def _lightning_entries(ckpt: str, saved: dict, trusted: bool) -> dict:
    """Lightning's entries of a checkpoint zerofn's Lightning strategy saved, less those
    only a resumed fit uses (Lightning needs its own classes to read them back), read as
    every extra is (safely, unless ``trusted``)."""
    key = f"extra.{LIGHTNING_EXTRA}"
    if key not in saved:
        raise ValueError(f"{ckpt} has no Lightning entries ({key}): it was not saved by "
                         "zerofn's Lightning strategy. Leave out --lightning for the weights "
                         "alone (a plain state dict file).")
    blob = {"extra": {LIGHTNING_EXTRA: b""}}
    with single_process():
        dcp.load(blob, storage_reader=SafeReader(ckpt, trusted=trusted),
                 planner=SafePlanner(trusted=trusted), no_dist=True)
    entries = pickles.load_entry(io.BytesIO(blob["extra"][LIGHTNING_EXTRA]),
                                 f"{ckpt}: extra {LIGHTNING_EXTRA!r}", trusted)
    return {k: v for k, v in entries.items() if k not in TRAINING_ONLY}


def to_dcp(full_file, out_dir, *, trusted: bool = False) -> None:
    """Write a ``{fqn: tensor}`` file (.safetensors or torch.save) as a checkpoint directory
    (with checksums), locally or at an fsspec URL. ``trusted``: read a torch.save file as
    torch would."""
    full_file, out_dir = fs.local_only(full_file, "The full state dict file"), os.fspath(out_dir)
    if fs.exists(out_dir):
        raise FileExistsError(f"{out_dir} exists; pick a new directory for the checkpoint.")
    model = _read_full(full_file, trusted)
    if fs.is_url(out_dir):     # in place: visible once its .metadata is, written last
        with single_process():
            dcp.save({"model": model}, storage_writer=ChecksumWriter(out_dir), no_dist=True)
        return
    tmp = out_dir.rstrip(os.sep) + ".tmp"
    with single_process():
        dcp.save({"model": model}, storage_writer=ChecksumWriter(tmp), no_dist=True)
    fs.replace(tmp, out_dir)   # complete or absent, never half written


@contextlib.contextmanager
def single_process():
    """DCP warns that it assumes one process even when told so with no_dist=True."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _writer_for(path: str):
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file
        return lambda sd, p: save_file({k: v.contiguous() for k, v in sd.items()}, p)
    if path.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return torch.save
    raise ValueError(f"{path}: name the output .safetensors, or .pt or .ckpt (torch.save).")


def _read_full(path: str, trusted: bool) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    with open(path, "rb") as f:
        sd = pickles.load_entry(f, path, trusted)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} is not a flat {{name: tensor}} state dict; save the "
                         "model's state_dict() itself.")
    return sd


def main(argv=None, prog: str = "python -m zerofn.consolidate") -> int:
    """The command line; ``prog`` names it in the help (the ``zerofn`` script passes its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    full = sub.add_parser("to-full", help="checkpoint -> one full state dict file")
    full.add_argument("checkpoint", help="a checkpoint root (uses its 'latest') or directory")
    full.add_argument("out", help="OUT.safetensors or OUT.pt")
    full.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                      help="dtype of floating tensors (default fp32)")
    full.add_argument("--lightning", action="store_true",
                      help="write a Lightning checkpoint (OUT.ckpt) that "
                           "LightningModule.load_from_checkpoint reads")
    back = sub.add_parser("to-dcp", help="full state dict file -> checkpoint directory")
    back.add_argument("full", help="FULL.safetensors or FULL.pt")
    back.add_argument("out", help="a new checkpoint directory")
    for command in (full, back):
        command.add_argument("--trusted", action="store_true",
                             help="read pickles as torch would, running them (only for files "
                                  "from a source you trust)")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-full":
            tensors = to_full(args.checkpoint, args.out, DTYPES[args.dtype], trusted=args.trusted,
                              lightning=args.lightning)
            print(f"wrote {len(tensors)} tensors, "
                  f"{sum(t.numel() for t in tensors.values())} elements, to {args.out}")
        else:
            to_dcp(args.full, args.out, trusted=args.trusted)
            print(f"wrote checkpoint {args.out}")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
