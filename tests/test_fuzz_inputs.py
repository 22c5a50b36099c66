"""The inputs fuzzed: what the fuzz found, each refused where it should have been."""
from __future__ import annotations

import pytest
import torch

import zerofn as zf
from zerofn import train

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
     "zero_optimization.allgather_bucket_size takes a whole number from 0 up; got -inf"),
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


@pytest.mark.parametrize("argv, says", FLAGS_REFUSED)
def test_flags_the_fuzz_found_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert says in capsys.readouterr().err
