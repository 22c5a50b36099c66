"""Convert a DeepSpeed ZeRO-1/2/3 checkpoint into a zerofn checkpoint.

    python -m zerofn.deepspeed.convert CKPT_DIR OUT_DIR [--tag TAG] [--trusted]

``CKPT_DIR`` is what ``engine.save_checkpoint(CKPT_DIR)`` wrote (its ``latest`` names the
checkpoint to read), one of its ``global_stepN`` directories, or the save dir with
``--tag``. The checkpoint may come from any data-parallel world size. ``OUT_DIR`` becomes
a checkpoint root as ``zerofn.save_checkpoint`` writes it (``OUT_DIR/step-N`` and
``OUT_DIR/latest``): ``zerofn.load_checkpoint(OUT_DIR, model, opt)`` loads it at any world
size and stage.

Kept: the fp32 master weights (not the 16-bit module copies), every per-element optimizer
state (Adam's two moments) and its step, the param groups' hyperparameters, the fp16 loss
scaler, frozen parameters, buffers, tied names, the global step (as the checkpoint's step)
and the client state given to ``save_checkpoint`` (as extras). DeepSpeed's own bookkeeping
rides along in one extra, ``deepspeed``. See docs/deepspeed_checkpoints.md.

DeepSpeed is not needed: its pickled objects are read by a restricted unpickler that gives
each DeepSpeed class an inert stand-in and refuses any other class a file names unless
``--trusted`` (``ds_files``), and the flat partitions are cut apart
from the layout facts written down in ``ds_partitions.zero12_params`` and ``zero3_params``.
``read_checkpoint`` (``ds_read``) reads it all into full tensors; this module writes them as
a zerofn checkpoint.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch.distributed.checkpoint as dcp
from ..io.checkpoint.checksums import ChecksumWriter
from ..io.checkpoint.extras import to_bytes
from ..io.checkpoint.layout import publish, step_name
from ..io.consolidate import single_process
from ..runtime.optimizer import SCALER_KEY
from .ds_read import DeepSpeedCheckpoint, read_checkpoint


def convert(path, out, tag: str | None = None, *,
            trusted: bool = False) -> tuple[str, DeepSpeedCheckpoint]:
    """Convert the DeepSpeed checkpoint at ``path`` into a zerofn checkpoint root ``out``.

    Args:
        path: a DeepSpeed save dir, or one ``global_stepN`` directory.
        out: the zerofn checkpoint root to write (created if missing); the converted
            checkpoint becomes ``out/step-N`` (N = DeepSpeed's global step) and ``latest``.
        tag: a checkpoint tag under ``path`` instead of its ``latest``.
        trusted: convert even where the files pickle classes other than DeepSpeed's (they
            are stood in for and dropped, never run); without it they are refused.

    Returns:
        ``(directory written, the DeepSpeedCheckpoint read)``.

    Example:
        >>> convert("ds_ckpt", "zf_ckpt")                    # doctest: +SKIP
        >>> zerofn.load_checkpoint("zf_ckpt", model, opt)    # doctest: +SKIP
        {'step': 100, 'epoch': 3, 'deepspeed': {...}}
    """
    ck = read_checkpoint(path, tag, trusted=trusted)
    root, name = os.fspath(out), step_name(ck.step)
    final, tmp = os.path.join(root, name), os.path.join(root, ".tmp-" + name)
    if os.path.exists(final):
        raise ValueError(f"{final} exists; convert into another OUT_DIR or remove it first.")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    extra = {"step": to_bytes(ck.step), **{k: to_bytes(v) for k, v in ck.extras.items()}}
    state = {"model": ck.model, "optim": ck.optim, "extra": extra}
    with single_process():
        dcp.save(state, storage_writer=ChecksumWriter(tmp), no_dist=True)
    publish(root, name, keep=None)
    return final, ck


def _summary(ck: DeepSpeedCheckpoint, final: str) -> str:
    n_state = len(ck.optim["state"])
    lines = [f"DeepSpeed ZeRO-{ck.stage} checkpoint {ck.path} (world size {ck.world}, "
             f"{ck.extras['deepspeed']['dtype']}, global step {ck.step})",
             f"-> {final}: {len(ck.model)} model entries, optimizer state for {n_state} "
             f"parameters in {len(ck.optim['param_groups'])} groups"
             + (", fp16 loss scale " + str(ck.optim[SCALER_KEY]["scale"]) if SCALER_KEY in ck.optim
                else ""),
             f"   extras: {', '.join(sorted(ck.extras))}"]
    return "\n".join(lines + [f"   note: {n}" for n in ck.notes])


def main(argv=None, prog: str = "python -m zerofn.deepspeed.convert") -> int:
    """The command line; ``prog`` names it in the help (a console script passes its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="DeepSpeed save dir (uses its 'latest') or a "
                                           "global_stepN directory")
    parser.add_argument("out", help="zerofn checkpoint root to write")
    parser.add_argument("--tag", help="checkpoint tag under CHECKPOINT instead of 'latest'")
    parser.add_argument("--trusted", action="store_true",
                        help="convert files that pickle classes other than DeepSpeed's (never "
                             "run; their values are dropped); only for a source you trust")
    args = parser.parse_args(argv)
    try:
        final, ck = convert(args.checkpoint, args.out, args.tag, trusted=args.trusted)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_summary(ck, final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
