"""The job's command line: its flags, their help and defaults."""
from __future__ import annotations

import argparse
import math
import sys

import torch

from zerofn.observe.failures import DEFAULT_TIMEOUT
from zerofn.nanogpt import PRESETS, GPTConfig

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPE_FLAGS = ("width", "heads", "ffn", "layers", "context")


class _OneLine(argparse.ArgumentParser):
    """A refusal on one line with where to look (argparse prints the whole usage first,
    which for this many flags buries it)."""

    def error(self, message: str):
        refuse(message)


def refuse(message: str) -> None:
    """argparse's form of a refusal, on one line, with where to look."""
    print(f"zerofn train: error: {' '.join(message.split())} (zerofn train --help lists "
          f"the flags)", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = _OneLine(
        prog="zerofn train",
        description="The main job: train a GPT on the built-in corpus with zerofn on every rank.",
        epilog="Precedence: an explicit flag wins over --config, which wins over the "
               "defaults shown. --model sets the shape; --width etc. override it.")
    run = p.add_argument_group("run")
    run.add_argument("--nproc", type=_whole(1), help="ranks to start on this machine when not "
                     "already under torchrun (default: the GPU count, else 2)")
    run.add_argument("--config", help="a DeepSpeed ds_config.json: stage, precision, offload, "
                     "batch sizes, accumulation, clipping, optimizer and scheduler")
    run.add_argument("--steps", type=_whole(1), default=200, help="optimizer steps in the whole run (default 200)")
    run.add_argument("--stop-at", type=_whole(1), help="end this run after that optimizer step "
                     "(saving a checkpoint), e.g. to fit a job's time limit; the LR "
                     "schedule still spans --steps")
    run.add_argument("--seed", type=int, default=0, help="seed for weights and batches "
                     "(default 0)")
    run.add_argument("--log-every", type=_whole(1), help="steps between progress lines when stdout "
                     "is not a terminal (config: steps_per_print; default 10)")
    run.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard logs to DIR "
                     "every --log-every steps: loss, tokens/s, the step-time breakdown, "
                     "communication and memory per rank (zf.tensorboard; config: the "
                     "tensorboard section; `zerofn report DIR` plots them)")
    run.add_argument("--eval-batches", type=_whole(1), default=8,
                     help="global batches of held-out text for the final validation "
                          "loss (default 8)")

    zero = p.add_argument_group("ZeRO")
    zero.add_argument("--stage", type=int, choices=(1, 2, 3), help="1 shards optimizer "
                      "state, 2 also gradients, 3 also parameters (default 3)")
    zero.add_argument("--precision", choices=sorted(PRECISIONS),
                      help="compute dtype (default fp32); the masters and optimizer state "
                           "are fp32 unless --master-dtype and --state-dtype store them in "
                           "fewer bits off the device. fp16 scales the loss dynamically")
    zero.add_argument("--offload", choices=("none", "cpu", "nvme"),
                      help="keep masters and optimizer state on the host or in a swap file")
    zero.add_argument("--nvme-path", help="directory for --offload nvme's swap files")
    zero.add_argument("--offload-params", action=argparse.BooleanOptionalAction,
                      help="ZeRO-3 with --offload: the parameter shards too")
    zero.add_argument("--offload-ratio", type=_ratio, metavar="R|auto",
                      help="the share of the optimizer state --offload keeps off the device, "
                           "0 to 1; the rest stays on the device (default 1: all). auto "
                           "(--offload cpu): after the first step, the units --device-budget "
                           "holds move to the device; the placement and its reason are "
                           "printed and logged to --tensorboard")
    zero.add_argument("--device-budget", type=_budget, metavar="BYTES|SHARE",
                      help="--offload-ratio auto: the device memory the run may use, in "
                           "bytes (a whole number) or as a share of the memory free at "
                           "set-up (in (0, 1]; default 0.9). On a CPU device give bytes: "
                           "the host is the device there, and a share is of a GPU's free "
                           "memory")
    zero.add_argument("--plan", choices=("auto",),
                      help="auto: stage, offload, stored dtypes, activation checkpointing "
                           "and the micro-batch from `zerofn plan`'s choice within "
                           "--device-budget (bytes) and --host-budget, printed with its "
                           "reason (docs/plan.md)")
    zero.add_argument("--host-budget", type=float, metavar="BYTES",
                      help="--plan auto: host memory per rank, in bytes (default the "
                           "host's available memory shared by this machine's ranks)")
    zero.add_argument("--probe", help="--plan auto: a `zerofn probe` JSON to plan with "
                                      "(default this machine's, probed once and cached)")
    zero.add_argument("--overlap-step", action="store_true",
                      help="--offload cpu, ZeRO-2/3, --clip 0, not fp16: the host steps each "
                           "unit during backward (micro-batches but the last accumulate "
                           "under no_sync)")
    zero.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"),
                      help="--offload: how Adam's moments are stored off the device (bf16 "
                           "rounds stochastically; int8: 8-bit blockwise codes; default fp32)")
    zero.add_argument("--master-dtype", choices=("fp32", "bf16"),
                      help="--offload: how the masters are stored (bf16 needs --precision "
                           "bf16; default fp32)")
    zero.add_argument("--tp", type=_whole(1), default=1, metavar="N",
                      help="tensor parallelism: split each block's attention heads and MLP "
                           "over N ranks (torch's parallelize_module: column-wise qkv and fc, "
                           "row-wise proj and out), then ZeRO over the ranks / N data-parallel "
                           "ranks, which split the batch. N must divide the ranks and --heads "
                           "(default 1: none; docs/parallelism.md)")
    zero.add_argument("--grad-accum", type=_whole(1),
                      help="micro-batches per optimizer step (default 1)")
    zero.add_argument("--activation-checkpointing", action="store_true",
                      help="recompute each block's activations in backward")
    zero.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                      help="torch.compile the sharded model (backend default inductor; "
                           "zerofn's hooks stay outside the graphs)")
    zero.add_argument("--clip", type=_number(0), help="global gradient-norm clip, 0 for none "
                      "(config: gradient_clipping; default 1.0)")

    model = p.add_argument_group("model and data")
    model.add_argument("--model", choices=tuple(PRESETS), default="small",
                       help="preset (default small): " + "; ".join(f"{k} {_millions(c)}"
                                                   for k, c in PRESETS.items()))
    for name in SHAPE_FLAGS:
        model.add_argument(f"--{name}", type=_whole(1), help=f"override the preset's {name}")
    model.add_argument("--batch", type=_whole(1), help="global batch in sequences per optimizer "
                       "step (config: train_batch_size; default 16)")
    model.add_argument("--lr", type=_number(0, above=True), help="peak learning rate (config: the optimizer's "
                       "lr; default 2e-3, AdamW with warm-up and cosine decay)")

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--save-dir", help="checkpoint root: model, optimizer, LR schedule, "
                      "data position and RNG; one path every rank sees (docs/checkpoints.md)")
    ckpt.add_argument("--save-every", type=_whole(1), help="optimizer steps between checkpoints "
                      "(default: only at the end)")
    ckpt.add_argument("--keep", type=_whole(1), default=3, help="newest checkpoints to keep "
                      "(default 3)")
    ckpt.add_argument("--resume", action="store_true", help="continue from --save-dir's "
                      "latest checkpoint, if it has one (else start afresh); implied when "
                      "torchrun restarts the job (TORCHELASTIC_RESTART_COUNT > 0 on any node)")

    failing = p.add_argument_group("failures")
    failing.add_argument("--timeout", type=_number(0, above=True), default=DEFAULT_TIMEOUT,
                         help="seconds a collective may wait for the slowest rank before "
                              "every rank stops with an error naming it (default "
                              f"{DEFAULT_TIMEOUT:g}; docs/multinode.md)")
    failing.add_argument("--on-nonfinite", choices=("skip", "raise", "ignore"),
                         help="a step whose gradients hold inf or nan on any rank: skip it on "
                              "every rank (default; under fp16 the loss scaler's skip), stop "
                              "the run naming the step and a parameter (raise; the default "
                              "under --overlap-step), or take it unchecked (ignore: no cost)")
    return p.parse_args(argv)


def _whole(low: int):
    """A flag's type: a whole number from ``low`` up (argparse names the flag)."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from {low} up")
        return value
    return whole


def _number(low: float, above: bool = False):
    """A flag's type: a finite number from ``low`` up (``above``: more than ``low``)."""
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low)):
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a finite number {'above' if above else 'from'} {low:g}"
                + ("" if above else " up"))
        return value
    return number


def _ratio(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:     # (nan too)
        raise argparse.ArgumentTypeError(f"{text!r}: give a share from 0 to 1, or auto")
    return value


def _budget(text: str) -> int | float:
    """Bytes as a whole number, else a share of the free device memory."""
    try:
        budget = int(text) if text.strip().isdigit() else float(text)
    except ValueError:
        budget = math.nan
    if not (budget > 0 and (isinstance(budget, int) or budget <= 1)):     # (nan too)
        raise argparse.ArgumentTypeError(
            f"{text!r}: give bytes as a whole number (e.g. {2**30}) or a share of the free "
            f"device memory in (0, 1] (e.g. 0.8)")
    return budget


def _millions(cfg: GPTConfig) -> str:
    n = cfg.params()
    return f"({n / 1e9:.2f}B)" if n >= 1e9 else f"({n / 1e6:.3g}M)"
