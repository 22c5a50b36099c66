"""The reference comparisons: which script runs which config, and the config both sides run.

Real DeepSpeed (``tools/deepspeed_reference.py``) and ``zerofn.deepspeed``
(``tests/test_deepspeed_engine.py``) run the same script with the same config on 2 gloo
ranks and record every micro-step's loss. The ``BF16`` cases train a model built in bf16
(a tiny Hugging Face Llama) in bf16 mode, as DeepSpeed's CPU accelerator runs it; the
others train in fp32. Two adjustments hold on both sides:

- fp16 runs as fp32 (``fp16.enabled`` false): DeepSpeed's CPU accelerator has no fp16.
  zerofn's fp16 loss scaling is exercised through the engine in a separate test.
- ``nvme_path`` points at a fresh temporary directory.
"""
from __future__ import annotations

import copy
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
STEPS = 6
# name: (script, config file)
CASES = {
    "zero2_offload_fp16": ("train_config_optimizer.py", "zero2_offload_fp16.json"),
    "zero2_nvme_accum": ("train_client_optimizer.py", "zero2_nvme_accum.json"),
    "zero3_offload": ("train_config_optimizer.py", "zero3_offload.json"),
    # DeepSpeed's ZeRO-3 example settings: its persistence threshold keeps every parameter
    # of a small model whole, so parameter offload has no sharded parameter at all.
    "zero3_persistent_fp16": ("train_client_optimizer.py", "zero3_persistent_fp16.json"),
    # bf16.enabled with a bf16-built model: fp32 masters and optimizer state on both sides.
    "zero2_bf16": ("train_causal_lm.py", "zero2_bf16.json"),
    "zero2_offload_bf16": ("train_causal_lm.py", "zero2_offload_bf16.json"),
    "zero3_bf16": ("train_causal_lm.py", "zero3_bf16.json"),
}
BF16 = ("zero2_bf16", "zero2_offload_bf16", "zero3_bf16")
DEEPSPEED_IMPORT = "import deepspeed\n"
ZEROFN_IMPORT = "import zerofn.deepspeed as deepspeed\n"


def deepspeed_source(name: str) -> str:
    with open(os.path.join(HERE, CASES[name][0])) as f:
        return f.read()


def zerofn_source(name: str) -> str:
    """The case's script with ``import deepspeed`` changed to zerofn's, and nothing else."""
    return "".join(ZEROFN_IMPORT if line == DEEPSPEED_IMPORT else line
                   for line in deepspeed_source(name).splitlines(keepends=True))


def load(name: str) -> dict:
    with open(os.path.join(HERE, CASES[name][1])) as f:
        return json.load(f)


def comparable_config(name: str, nvme_dir: str) -> dict:
    """The case's config as both sides run it (see the module docstring)."""
    config = copy.deepcopy(load(name))
    if "fp16" in config:
        config["fp16"]["enabled"] = False
    zero = config.get("zero_optimization", {})
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section, {}).get("device") == "nvme":
            zero[section]["nvme_path"] = nvme_dir
    return config


def script_args(config_path: str, losses: str) -> list[str]:
    return ["--deepspeed_config", config_path, "--steps", str(STEPS), "--losses", losses]


def read_losses(prefix: str) -> dict:
    """``{"rank0": {...}, "rank1": {...}}`` as the script wrote them."""
    out = {}
    for rank in range(WORLD):
        with open(f"{prefix}.rank{rank}.json") as f:
            out[f"rank{rank}"] = json.load(f)
    return out
