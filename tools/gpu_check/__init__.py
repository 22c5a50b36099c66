"""The one command for a lent GPU: what zerofn's CUDA path does that a CPU cannot show.

    python3 tools/gpu_check.py                            # every part
    python3 tools/gpu_check.py --parts build,tests,race   # some parts; results accumulate
    python3 tools/gpu_check.py --parts build,pending --budget 540
                                  # the parts not passed yet that fit in 540 s, after a build
    python3 tools/gpu_check.py --plan                     # docs/gpu.md as "not yet run"
    python3 tools/gpu_check.py --render                   # docs/gpu.md again from the
                                  # results as they are (after parts.toml changed), no run

It runs offline on a machine with a CUDA build of torch (2.11 or later) installed and no
package index. Each part is recorded whether it passes or fails, and a failure does not
stop the parts after it; docs/gpu.md is rewritten from every result so far after each
part, so a run cut short still leaves a report. Results accumulate in ``--results``
(docs/gpu_results.json, committed beside the report, so a later session on another
machine goes on with the parts still pending), each with the device, torch and commit it
ran on. ``--copy-to DIR`` also copies the report, the results and the profiler trace
there. Nothing in the report is written by hand: every figure comes from a run.

The parts come in the order of what a short lease should show first: that zerofn builds
and trains correctly on CUDA, then the goals, then the stress and peer runs. A lease of
15 minutes of device time (a start of a minute or two included) fits one command of
``--parts build,pending --budget 540`` and a second, shorter one of what is left; the
int8-state ladder (``largest_int8``, up to 13.2B, 8 minutes) takes a command of its own,
``--parts build,largest_int8 --budget 540``. "Offload only what does not fit" takes two
commands of its own, ``--parts build,split,split_ds --budget 540`` (about 2 minutes, 5
with DeepSpeed) and ``--parts build,split_7b --budget 540`` (about 5 minutes).

The package (``tools/gpu_check.py`` runs it, as does ``python3 tools/gpu_check``):

- ``parts.toml``: the words of the page: each part's description and limit, the goals and
  their targets, the table of what NCCL does that gloo does not; ``catalog.py`` loads it,
  with the sizes and flags of the runs that its prose names.
- ``__main__.py``: the command line: which parts run, within what budget, and what each
  run writes.
- ``parts.py``: the build, the CUDA tests, race, compile and the main job, and the table of
  every part's runner; ``parity.py``, ``profiling.py`` and ``benchmarks.py`` the parts of
  their names (``benchmarks.py``: each part that runs ``tools/bench_offload.py``;
  ``muon.py``: the part that runs ``tools/bench_muon.py``).
- ``results.py``: the results file, the environment each part ran in, pending parts.
- ``report.py``: the goals' verdicts and docs/gpu.md, rendered from the results.
- ``commands.py``, ``paths.py``: the subprocess runner and pytest's summary; where things go.

Only ``parity.py`` imports from ``tests/support`` (the parity suite's model, loops and
ranks, which the GPU runs as the suite does on the CPU); nothing under tests/ is otherwise
a tool's, and ``tests/test_gpu_check.py`` imports this package from ``tools/``.
"""
