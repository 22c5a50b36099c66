"""The inputs fuzzed (hypothesis; support/fuzz_inputs.py): DeepSpeed configs drawn from
every key zerofn knows (right and wrong types, out-of-range values, unknown keys, "auto"
where it is and is not allowed), the transforms' options and ``zerofn train``'s flags.
Every case trains a step or raises zerofn's own error naming the key, option or flag:
never an internal exception. The suite draws a few examples of each surface (fixed, so a
run is repeatable); the long run draws that many per surface, afresh:

    ZEROFN_FUZZ_EXAMPLES=3400 python -m pytest -q -p no:cacheprovider tests/test_fuzz_inputs.py

Below the fuzz, the cases it found, each fixed where the input should have been refused."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import zerofn as zf
from support.fuzz_inputs import (config_case, deepspeed_configs, flags_case, held_to_the_rule,
                                 leaf_names, option_names, options_case, train_flags,
                                 transform_options)
from support.errors import error_of
from support.ranks import run_ranks
from zerofn import train

EXAMPLES = int(os.environ.get("ZEROFN_FUZZ_EXAMPLES", "20"))
SURFACES = {   # name: (strategy, case(drawn, nvme dir), what an error about it may name)
    "configs": (deepspeed_configs, lambda d, _: config_case(d[0]), lambda d: leaf_names(d[1])),
    "options": (transform_options, lambda d, nvme: options_case(*d, nvme),
                lambda d: option_names(*d)),
    "flags": (train_flags, lambda d, nvme: flags_case(d[0], nvme), lambda d: d[1]),
}


def fuzz(rank, world, surface, examples):
    """Draw ``examples`` cases of ``surface`` in a fresh directory (a drawn tensorboard
    section or NVMe path writes there); how many trained a step and how many were refused."""
    strategy, run, names = SURFACES[surface]
    counts = {"trained": 0, "refused": 0}

    @settings(max_examples=examples, deadline=None, database=None,
              derandomize="ZEROFN_FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=list(HealthCheck))
    @given(strategy())
    def case(drawn):
        counts[held_to_the_rule(lambda: run(drawn, nvme), names(drawn))] += 1

    with tempfile.TemporaryDirectory() as cwd:
        os.chdir(cwd)
        nvme = os.path.join(cwd, "nvme")
        os.mkdir(nvme)
        case()
    return counts


@pytest.mark.multirank
@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_input_trains_a_step_or_is_refused_by_name(surface):
    [counts] = run_ranks(1, fuzz, surface, EXAMPLES, timeout=max(180, EXAMPLES))
    print(surface, counts)
    assert sum(counts.values()) == EXAMPLES and counts["trained"] and counts["refused"], counts


# -- what the fuzz found -------------------------------------------------------------------
BASE = {"train_micro_batch_size_per_gpu": 2}
CONFIGS_REFUSED = [   # (the drawn config, less BASE; what the error says)
    # a section of another type reached .get or .items (AttributeError)
    ({"activation_checkpointing": None}, "activation_checkpointing must be an object {...}"),
    ({"fp16": 2}, "fp16 must be an object {...}"),
    ({"zero_optimization": None}, "zero_optimization must be an object {...} or true/false"),
    ({"optimizer": {"params": [1, 2]}}, "optimizer.params must be an object {...} or null"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": [1, 0]}},
     "zero_optimization.offload_optimizer must be an object {...} or null"),
    # a null optimizer section (absent, as DeepSpeed reads it) reached .get
    ({"optimizer": None, "bf16": {"enabled": True}}, None),
    # a value of the wrong kind or range reached int(), float() or the scaler (TypeError,
    # ValueError or OverflowError naming nothing)
    ({"zero_optimization": {"stage": 3, "param_persistence_threshold": ""}},
     "zero_optimization.param_persistence_threshold takes a whole number from 0 up; got ''"),
    ({"zero_optimization": {"stage": 0, "allgather_bucket_size": -float("inf")}},
     "zero_optimization.allgather_bucket_size takes a whole number from 1 up; got -inf"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": []}},
     "zero_optimization.stage3_prefetch_bucket_size takes a whole number"),
    ({"gradient_clipping": None}, "gradient_clipping takes a number from 0 up; got None"),
    ({"fp16": {"enabled": True, "hysteresis": False}}, "fp16.hysteresis takes a whole number"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale takes a number "
     "above 0"),
    ({"csv_monitor": {"enabled": -0.5}}, "csv_monitor.enabled takes true or false"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 2}}},
     "zero_optimization.offload_optimizer.ratio takes a number from 0 to 1; got 2"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}, None),   # (JSON's 5e8)
    # a bucket size of 0 became bucket_size=0, which the transform refused by its own name
    ({"zero_optimization": {"stage": 2, "allgather_bucket_size": 0}},
     "zero_optimization.allgather_bucket_size takes a whole number from 1 up; got 0"),
    ({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 0}}, None),   # no prefetch
]


@pytest.mark.parametrize("config, says", CONFIGS_REFUSED)
def test_configs_the_fuzz_found_are_read_or_refused_by_name(config, says):
    if says is None:      # read as it should be
        zf.from_deepspeed_config({**BASE, **config}, world_size=1)
        return
    with pytest.raises(ValueError) as e:
        zf.from_deepspeed_config({**BASE, **config}, world_size=1)
    assert says in str(e.value), str(e.value)


OPTIONS_REFUSED = [   # (the transform the fuzz drew, what the error says)
    # values of the wrong kind went on to the runtime (TypeError or OverflowError there)
    (lambda: zf.shard_optimizer(bucket_size="cpu"),
     "zerofn.shard_optimizer(bucket_size='cpu'): bucket_size takes a whole number from 1 up"),
    (lambda: zf.shard_params(timeout=2**63), "timeout takes a finite number above 0, at most 1e+09"),
    (lambda: zf.shard_grads(sync_module_states="none"), "sync_module_states takes True or False"),
    (lambda: zf.mixed_precision(torch.float16, hysteresis=False), "hysteresis takes a whole number"),
    (lambda: zf.mixed_precision(torch.bfloat16, loss_scale={}), "loss_scale takes a finite number"),
    (lambda: zf.mixed_precision(torch.bfloat16, initial_scale_power=1e30),
     "initial_scale_power takes a whole number from 0 to 64"),
    (lambda: zf.offload("cpu", units_in_flight=[2]), "units_in_flight takes a whole number"),
    (lambda: zf.offload("cpu", seed=None), "seed takes a whole number from 0 up"),
]


@pytest.mark.parametrize("make, says", OPTIONS_REFUSED)
def test_options_the_fuzz_found_are_refused_by_name(make, says):
    with pytest.raises(ValueError) as e:
        make()
    assert says in str(e.value), str(e.value)


FLAGS_REFUSED = [   # (the flags the fuzz drew, what argparse says)
    # --heads 0 divided by zero in the job's checks; --context -1 reached torch.empty;
    # --lr -1 reached torch.optim's own message (naming no flag)
    (["--heads", "0"], "argument --heads: '0': give a whole number from 1 up"),
    (["--context", "-1"], "argument --context: '-1': give a whole number from 1 up"),
    (["--lr", "-1"], "argument --lr: '-1': give a finite number above 0"),
    (["--clip", "nan"], "argument --clip: 'nan': give a finite number from 0 up"),
    (["--offload-ratio", "nan"], "argument --offload-ratio: 'nan': give a share from 0 to 1"),
]


def flags_resolved(rank, world, argv):
    return error_of(train.resolve, train.parse_args(argv), torch.device("cpu"))


def test_a_missing_nvme_path_is_named_by_its_flag():
    """--offload nvme --nvme-path -1 was refused only by offload() at set-up, naming the
    path but not the flag."""
    [says] = run_ranks(1, flags_resolved, ["--offload", "nvme", "--nvme-path", "-1"])
    assert says and "--nvme-path -1 (or the config's nvme_path) is not an existing directory" \
        in says, says


@pytest.mark.parametrize("argv, says", FLAGS_REFUSED)
def test_flags_the_fuzz_found_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert says in capsys.readouterr().err


def test_factories_the_fuzz_found_are_refused_by_name():
    """A scheduler without a parameter it needs (WarmupCosineLR's total_num_steps), or an
    optimizer parameter torch refuses, left torch's TypeError or ValueError naming no key."""
    params = [torch.zeros(2, requires_grad=True)]
    for config, says in (({"scheduler": {"type": "WarmupCosineLR"}}, "scheduler.params"),
                         ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}},
                          "optimizer.params")):
        s = zf.from_deepspeed_config({**BASE, **config}, world_size=1)
        with pytest.raises(ValueError) as e:
            opt = (s.optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)))(params)
            s.scheduler(opt)
        assert says in str(e.value) and "DeepSpeed config" in str(e.value), str(e.value)
