"""Record real DeepSpeed's numbers for zerofn.deepspeed's tests (tests/data/deepspeed/*.json).

Runs the DeepSpeed-style scripts in tests/deepspeed_scripts/ under real DeepSpeed on 2
gloo ranks (CPU accelerator), every micro-step's loss recorded with the dtypes of what
DeepSpeed's ZeRO optimizer holds at the end (its master partitions, the state of the
optimizer under it, the module's parameters), and records DeepSpeed's own WarmupLR /
WarmupDecayLR / WarmupCosineLR values. DeepSpeed is never a dependency of
zerofn or its tests: run this with the interpreter that has it, e.g.

    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python tools/deepspeed_reference.py

DeepSpeed cannot read "auto": the config handed to it has "auto" filled by Hugging Face's
own integration (``HfTrainerDeepSpeedConfig``), given TrainingArguments that agree with
the config's explicit values. Where DeepSpeed's CPU build has no async I/O (libaio), its
side of an NVMe case runs with CPU offload instead; the JSON says so.

``--compare`` runs the same scripts through zerofn.deepspeed instead (only the import
changed; no DeepSpeed needed) and prints each case's largest loss difference to the
recorded DeepSpeed losses:

    python3 tools/deepspeed_reference.py --compare
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "deepspeed_scripts")
OUT = os.path.join(ROOT, "tests", "data", "deepspeed")
sys.path.insert(0, SCRIPTS)

import cases  # noqa: E402  (tests/deepspeed_scripts, put on the path above)


def main() -> None:
    if sys.argv[1:2] == [AS_RANK]:      # one rank of a DeepSpeed run that run_script started
        run_rank(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(cases.CASES),
                        help="which cases to run (default: all)")
    parser.add_argument("--no-schedulers", action="store_true",
                        help="skip recording the scheduler values")
    parser.add_argument("--compare", action="store_true",
                        help="run the scripts on zerofn and compare with the recorded losses")
    args = parser.parse_args()
    if args.compare:
        for name in args.cases:
            compare_case(name)
        return
    import deepspeed
    os.makedirs(OUT, exist_ok=True)
    for name in args.cases:
        record_case(name, deepspeed.__version__)
    if not args.no_schedulers:
        record_schedulers(deepspeed.__version__)


# -- the training runs ------------------------------------------------------------------------
AS_RANK = "--as-rank"


def run_script(entry: list[str], config: dict, tmp: str, env: dict) -> tuple[dict, str]:
    """``entry`` (a script and the arguments before its own) on 2 ranks under torchrun with
    ``config``; the losses it recorded, and the prefix of the files it wrote."""
    config_path = os.path.join(tmp, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    prefix = os.path.join(tmp, "losses")
    subprocess.run([sys.executable, "-m", "torch.distributed.run",
                    f"--nproc-per-node={cases.WORLD}", *entry]
                   + cases.script_args(config_path, prefix), check=True,
                   env=dict(env, OMP_NUM_THREADS="1"))
    return cases.read_losses(prefix), prefix


def run_rank(script: str, argv: list[str]) -> None:
    """One rank: ``script`` with ``argv`` as ``python script argv`` runs it, then the dtypes of
    what DeepSpeed's optimizer holds after training, next to the losses it wrote."""
    import runpy
    import deepspeed
    engines, initialize = [], deepspeed.initialize

    def kept(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engines.append(out[0])
        return out

    deepspeed.initialize = kept
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")
    prefix = argv[argv.index("--losses") + 1]
    with open(f"{prefix}.rank{engines[0].global_rank}.dtypes.json", "w") as f:
        json.dump(optimizer_dtypes(engines[0]), f)


def optimizer_dtypes(engine) -> dict:
    """The dtypes DeepSpeed trains with: its ZeRO optimizer's master partitions
    (``single_partition_of_fp32_groups`` at stages 1 and 2, ``fp32_partitioned_groups_flat``
    at stage 3), the state of the optimizer it steps them with (the step counter left out),
    and the module's parameters."""
    import torch
    zero = engine.optimizer
    masters = getattr(zero, "single_partition_of_fp32_groups", None) \
        or zero.fp32_partitioned_groups_flat
    state: dict[str, set] = {}
    for per_param in zero.optimizer.state.values():
        for key, value in per_param.items():
            if torch.is_tensor(value) and key != "step":
                state.setdefault(key, set()).add(str(value.dtype))
    return {"optimizer": f"{type(zero).__name__} over {type(zero.optimizer).__name__}",
            "masters": sorted({str(m.dtype) for m in masters}),
            "state": {key: sorted(dtypes) for key, dtypes in sorted(state.items())},
            "module_parameters": sorted({str(p.dtype) for p in engine.module.parameters()})}


def record_case(name: str, version: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config, notes = deepspeed_config(name, tmp)
        script = os.path.join(SCRIPTS, cases.CASES[name][0])
        ranks, prefix = run_script([os.path.abspath(__file__), AS_RANK, script], config, tmp,
                                   dict(os.environ, DS_ACCELERATOR="cpu"))
        for rank, record in ranks.items():
            with open(f"{prefix}.{rank}.dtypes.json") as f:
                record["dtypes"] = json.load(f)
        config = json.loads(json.dumps(config).replace(tmp, "<tmp>"))   # same on every run
    record = {"deepspeed": version, "world_size": cases.WORLD, "steps": cases.STEPS,
              "script": cases.CASES[name][0], "config_file": cases.CASES[name][1],
              "deepspeed_config": config, "notes": notes, "ranks": ranks}
    _write(f"{name}.json", record)


def compare_case(name: str) -> None:
    """The case on zerofn.deepspeed, against the recorded DeepSpeed losses."""
    with open(os.path.join(OUT, f"{name}.json")) as f:
        recorded = json.load(f)["ranks"]
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "nvme"))
        script = os.path.join(tmp, "zerofn_" + cases.CASES[name][0])
        with open(script, "w") as f:
            f.write(cases.zerofn_source(name))
        path = os.pathsep.join([SCRIPTS, os.environ.get("PYTHONPATH", "")])
        ranks, _ = run_script([script], cases.comparable_config(name, os.path.join(tmp, "nvme")),
                              tmp, dict(os.environ, PYTHONPATH=path))
    for rank, ref in recorded.items():
        ours = ranks[rank]["losses"]
        worst = max(abs(a - b) for a, b in zip(ours, ref["losses"]))
        print(f"{name} {rank}: {len(ours)} micro-steps (DeepSpeed {len(ref['losses'])}), "
              f"max |loss difference| {worst:.2e}")


def deepspeed_config(name: str, tmp: str) -> tuple[dict, list[str]]:
    """The comparable config with "auto" filled by Hugging Face, and NVMe swapped for CPU
    offload where DeepSpeed has no async I/O."""
    notes = ["fp16.enabled is false on both sides: DeepSpeed's CPU accelerator has no fp16"] \
        if "fp16" in cases.load(name) else []
    config = hf_resolved(cases.comparable_config(name, os.path.join(tmp, "nvme")))
    zero = config.get("zero_optimization", {})
    nvme = [s for s in ("offload_optimizer", "offload_param")
            if zero.get(s, {}).get("device") == "nvme"]
    if nvme and not _has_async_io():
        for section in nvme:
            zero[section]["device"] = "cpu"
        notes.append(f"DeepSpeed's CPU build has no async I/O (libaio missing), so its side ran "
                     f"{nvme} with device cpu; zerofn's side ran them on nvme")
    elif nvme:
        os.makedirs(os.path.join(tmp, "nvme"), exist_ok=True)
    return config, notes


def _has_async_io() -> bool:
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


def hf_resolved(config: dict) -> dict:
    """``config`` with every "auto" filled by Hugging Face's ``HfTrainerDeepSpeedConfig``."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    from tiny import make_model
    hf = HfTrainerDeepSpeedConfig(config)
    args, total_steps = _training_args(config)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, make_model(), total_steps)
    return hf.config


def _number(value, default):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _training_args(config: dict):
    """TrainingArguments' fields that Hugging Face reads, agreeing with the config's explicit
    values (it raises on a mismatch) and its defaults elsewhere."""
    opt = config.get("optimizer", {}).get("params", {})
    sched = config.get("scheduler", {}).get("params", {})
    betas = opt.get("betas") if isinstance(opt.get("betas"), list) else [0.9, 0.999]
    lr = _number(opt.get("lr"), _number(sched.get("warmup_max_lr"), 5e-5))
    warmup = _number(sched.get("warmup_num_steps"), 0)
    args = types.SimpleNamespace(
        world_size=cases.WORLD,
        per_device_train_batch_size=_number(config.get("train_micro_batch_size_per_gpu"), 8),
        gradient_accumulation_steps=_number(config.get("gradient_accumulation_steps"), 1),
        max_grad_norm=_number(config.get("gradient_clipping"), 1.0),
        learning_rate=lr, adam_beta1=betas[0], adam_beta2=betas[1],
        adam_epsilon=_number(opt.get("eps"), 1e-8),
        weight_decay=_number(opt.get("weight_decay"), 0.0), save_on_each_node=False,
        fp16=config.get("fp16", {}).get("enabled") is True, fp16_full_eval=False,
        bf16=config.get("bf16", {}).get("enabled") is True, bf16_full_eval=False,
        get_warmup_steps=lambda steps: warmup)
    return args, _number(sched.get("total_num_steps"), cases.STEPS)


# -- the schedulers ----------------------------------------------------------------------------
SCHEDULE_STEPS = 14
SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": [0.001, 0.002], "warmup_max_lr": [0.01, 0.03],
                  "warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                       "warmup_num_steps": 3}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_min_lr": 0.002, "warmup_max_lr": 0.02,
                       "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 3,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 2, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 2, "warmup_num_steps": 4, "cos_min_ratio": 0.05}),
]
BASE_LRS = [0.02, 0.05]     # two param groups


def record_schedulers(version: str) -> None:
    import torch
    from deepspeed.runtime import lr_schedules
    records = []
    for name, params in SCHEDULES:
        weights = [torch.nn.Parameter(torch.zeros(1)) for _ in BASE_LRS]
        opt = torch.optim.SGD([{"params": [w], "lr": lr} for w, lr in zip(weights, BASE_LRS)])
        sched = getattr(lr_schedules, name)(opt, **params)
        lrs = [[g["lr"] for g in opt.param_groups]]
        for _ in range(SCHEDULE_STEPS):
            sched.step()
            lrs.append([g["lr"] for g in opt.param_groups])
        assert all(math.isfinite(v) for row in lrs for v in row)
        records.append({"type": name, "params": params, "base_lrs": BASE_LRS,
                        "lrs_after_init_then_each_step": lrs})
    _write("schedulers.json", {"deepspeed": version, "schedules": records})


def _write(filename: str, record: dict) -> None:
    path = os.path.join(OUT, filename)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
