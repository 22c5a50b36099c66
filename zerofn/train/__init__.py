"""The main job: train a GPT on the built-in corpus with zerofn on every rank.

    zerofn train                                  # small GPT, ZeRO-3, 2 ranks, 200 steps
    zerofn train --config ds_config.json --model 125m --nproc 2
    torchrun --standalone --nproc-per-node 2 -m zerofn.train --stage 2 --precision bf16

Started outside torchrun, it starts itself under ``torch.distributed.run`` with ``--nproc``
ranks. Each optimizer step draws one global batch (a generator seeded by the seed and the
step), split into ``--grad-accum`` micro-batches and each of those across the ranks, so a
run's losses do not depend on how it was split or interrupted. gloo on CPU, NCCL on GPUs
(one per ``LOCAL_RANK``). The model is built on the meta device; the transforms
materialize only this rank's rows.

This package is a program, not part of the library: nothing in zerofn imports it
(``zerofn/cli.py`` runs it for ``zerofn train``), and it uses zerofn as a training script
of one's own would, through public names: ``zerofn``'s, ``zerofn.nanogpt``,
``zerofn.data`` and ``zerofn.core.estimate`` (the estimate's formulas). Not yet public: ``runtime_of`` from
``zerofn.runtime.runtime`` (the units, plan and device the banner names, ratio="auto"'s
placement it prints, the device restarts are agreed on, the step failures name) and
``DEFAULT_TIMEOUT``, ``default_store`` and ``translate`` from ``zerofn.observe.failures``.

    args.py      the command line
    launch.py    starting under torchrun; the process group; restarts
    job.py       what to run (flags over the config over defaults), its transforms, and
                 the model, optimizer and schedule built for it
    tensor_parallel.py  --tp N: the GPT split over a (dp, tp) mesh before zerofn
    loop.py      the steps, the validation loss, checkpoints saved and resumed
    progress.py  what rank 0 prints
    errors.py    one message for an error across ranks
    entry.py     main(): launch, set up, train, and the exit status
"""
from .args import parse_args
from .entry import main
from .errors import fp16_kernels_missing
from .job import resolve
from .launch import restarted, without_nproc

# main for zerofn's command line; the rest for the tests, which check these parts alone.
__all__ = ["main", "parse_args", "resolve", "fp16_kernels_missing", "restarted",
           "without_nproc"]
