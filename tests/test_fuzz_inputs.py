"""The inputs fuzzed: what the fuzz found, each refused where it should have been."""
from __future__ import annotations

import pytest

import zerofn as zf

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
]


@pytest.mark.parametrize("config, says", CONFIGS_REFUSED)
def test_configs_the_fuzz_found_are_read_or_refused_by_name(config, says):
    if says is None:      # read as it should be
        assert zf.from_deepspeed_config({**BASE, **config}, world_size=1).optimizer is None
        return
    with pytest.raises(ValueError) as e:
        zf.from_deepspeed_config({**BASE, **config}, world_size=1)
    assert says in str(e.value), str(e.value)
