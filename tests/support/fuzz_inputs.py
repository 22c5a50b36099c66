"""The input fuzz (tests/test_fuzz_inputs.py): hypothesis strategies that draw DeepSpeed
configs from every key ``zerofn/deepspeed/keys.py`` knows, the transforms' options and
``zerofn train``'s flags, right and wrong, and the one rule every case is held to: it
trains a step, or it raises zerofn's own error (a ValueError or TypeError, or argparse's
for a flag) that names what was wrong."""
from __future__ import annotations

import copy
import warnings

import torch
from hypothesis import strategies as st

import zerofn as zf
from zerofn.deepspeed import keys as K
from zerofn.runtime import runtime_of

from .models import batches, make_models

NAN, INF = float("nan"), float("inf")

# -- values ---------------------------------------------------------------------------------
# Anything JSON can hold, and the numbers at the edges (DeepSpeed reads JSON: no tuples).
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([-1, 0, 10**12, 2**63]),
    st.sampled_from([NAN, INF, -INF, -0.5, 0.5, 1e-12, 1e30]),
    st.sampled_from(["auto", "", "none", "cpu", "nvme", "fp16", "bf16", "AdamW", "x" * 3]),
    st.lists(st.integers(0, 2), max_size=2), st.just({}), st.just({"enabled": True}))
SIZE = st.sampled_from([0, 1, 1000, 50_000_000])

# The values a key means, where its type says more than JUNK does (the rest draw JUNK).
GOOD = {
    "train_batch_size": st.sampled_from([2, 4, "auto"]),
    "train_micro_batch_size_per_gpu": st.sampled_from([1, 2, "auto"]),
    "gradient_accumulation_steps": st.sampled_from([1, 2, "auto"]),
    "gradient_clipping": st.sampled_from([0.0, 1.0, "auto"]),
    "steps_per_print": st.sampled_from([1, 10]),
    "communication_data_type": st.sampled_from(["fp32", "bf16", "fp16", "torch.float32"]),
    "zero_optimization.stage": st.integers(0, 3),
    "zero_optimization.reduce_bucket_size": SIZE | st.just("auto"),
    "zero_optimization.allgather_bucket_size": SIZE,
    "zero_optimization.prefetch_bucket_size": SIZE | st.just("auto"),
    "zero_optimization.stage3_prefetch_bucket_size": SIZE | st.just("auto"),
    "zero_optimization.param_persistence_threshold": SIZE | st.just("auto"),
    "zero_optimization.stage3_param_persistence_threshold": SIZE | st.just("auto"),
    "zero_optimization.offload_optimizer": st.fixed_dictionaries(
        {"device": st.sampled_from(["none", "cpu", "nvme"])},
        optional={"pin_memory": st.booleans(), "ratio": st.sampled_from([0.0, 0.5, 1.0])}),
    "zero_optimization.offload_param": st.fixed_dictionaries(
        {"device": st.sampled_from(["none", "cpu", "nvme"])},
        optional={"buffer_count": st.integers(1, 4)}),
    "zero_optimization.offload_optimizer.device": st.sampled_from(["none", "cpu", "nvme"]),
    "zero_optimization.offload_param.device": st.sampled_from(["none", "cpu", "nvme"]),
    "zero_optimization.offload_optimizer.ratio": st.sampled_from([0.0, 0.3, 1.0]),
    "zero_optimization.offload_param.buffer_count": st.integers(1, 4),
    "fp16.enabled": st.booleans() | st.just("auto"),
    "bf16.enabled": st.booleans() | st.just("auto"),
    "fp16.loss_scale": st.sampled_from([0, 128.0]),
    "fp16.initial_scale_power": st.integers(0, 20),
    "fp16.loss_scale_window": st.integers(1, 1000),
    "fp16.hysteresis": st.integers(1, 4),
    "fp16.min_loss_scale": st.sampled_from([1, 0.5]),
    "optimizer.type": st.sampled_from(["Adam", "AdamW", "SGD", "Adagrad", "Lamb", "adamw"]),
    "optimizer.params.lr": st.sampled_from([1e-3, "auto"]),
    "optimizer.params.betas": st.sampled_from([[0.9, 0.999], "auto"]),
    "optimizer.params.eps": st.sampled_from([1e-8, "auto"]),
    "optimizer.params.weight_decay": st.sampled_from([0.0, 0.01, "auto"]),
    "optimizer.params.torch_adam": st.booleans(),
    "optimizer.params.adam_w_mode": st.booleans(),
    "scheduler.type": st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                       "StepLR", "OneCycle"]),
    "scheduler.params.warmup_min_lr": st.sampled_from([0, "auto"]),
    "scheduler.params.warmup_max_lr": st.sampled_from([1e-3, "auto"]),
    "scheduler.params.warmup_num_steps": st.sampled_from([1, 10, "auto"]),
    "scheduler.params.total_num_steps": st.sampled_from([10, 100, "auto"]),
    "scheduler.params.step_size": st.sampled_from([1, 5]),
    "tensorboard.enabled": st.booleans(),
    "csv_monitor.enabled": st.booleans(),
}
SECTION_PARAMS = {"optimizer.params": ("lr", "betas", "eps", "weight_decay", "momentum",
                                       "torch_adam", "adam_w_mode", "bias_correction"),
                  "scheduler.params": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                       "total_num_steps", "warmup_type", "step_size")}


def known_paths() -> list[str]:
    """Every dotted key keys.py knows, each section's own keys under it."""
    sections = {"": K.TOP_KNOWN, "zero_optimization.": K.ZERO_KNOWN,
                "zero_optimization.offload_optimizer.": K.OFFLOAD_OPTIMIZER_KNOWN,
                "zero_optimization.offload_param.": K.OFFLOAD_PARAM_KNOWN,
                "fp16.": K.FP16_KNOWN, "bf16.": K.BF16_KNOWN, "optimizer.": K.OPTIMIZER_KNOWN,
                "scheduler.": K.SCHEDULER_KNOWN, "tensorboard.": K.WRITER_KNOWN,
                "csv_monitor.": K.WRITER_KNOWN,
                "activation_checkpointing.": K.ACTIVATION_CHECKPOINTING_KNOWN}
    paths = [prefix + key for prefix, known in sections.items() for key in sorted(known)]
    paths += [f"{section}.{key}" for section, keys in SECTION_PARAMS.items() for key in keys]
    return paths + ["bogus_key", "zero_optimization.bogus_key", "fp16.bogus_key"]


PATHS = known_paths()


@st.composite
def deepspeed_configs(draw):
    """A config that trains as it stands, then one to three keys set to drawn values:
    ``(config, the dotted paths set)``."""
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": draw(st.integers(0, 3))}}
    changed = []
    for path in draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=3, unique=True)):
        value = draw(GOOD[path] | JUNK if path in GOOD else JUNK)
        if path.endswith("nvme_path") or value == "nvme":
            config.setdefault("zero_optimization", {})
        _set(config, path, value)
        changed.append(path)
    return config, changed


def _set(config: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = config
    for name in parents:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[leaf] = copy.deepcopy(value)     # (a drawn dict must not be shared by cases)


# -- the rule -------------------------------------------------------------------------------
class Internal(AssertionError):
    """A case raised something other than zerofn's own error naming what was wrong."""


def held_to_the_rule(fn, names: list[str]) -> str:
    """Run ``fn`` (a case: it trains a step). "trained", or "refused" where it raised a
    ValueError or TypeError naming one of ``names``; anything else raises ``Internal``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except (ValueError, TypeError) as e:
        if any(name in str(e) for name in names):
            return "refused"
        raise Internal(f"{type(e).__name__} naming none of {names}: {e}") from e
    except Exception as e:      # noqa: BLE001 (the point: nothing else may escape)
        raise Internal(f"internal {type(e).__name__}: {e}") from e
    return "trained"


def leaf_names(paths: list[str]) -> list[str]:
    """What an error about ``paths`` may name: each key, its section, or a stage3_ alias's
    other spelling."""
    out = []
    for path in paths:
        parts = path.split(".")
        out += parts + [p.removeprefix("stage3_") for p in parts]
    return out


def train_one_step(transform, optimizer=None, scheduler=None, clip: float = 0.0) -> None:
    """The parity model (its optimizer from ``optimizer``, a factory, else AdamW) under
    ``transform``, one step on one batch, clipped at ``clip`` where positive."""
    _, model = make_models()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=1e-3)
    model, opt = transform(model, opt)
    sched = scheduler(opt) if scheduler is not None else None
    (x, y), = batches(1, 1, 1)[0]
    zf.scale_loss(model, model(x, y)).backward()
    if clip > 0:
        zf.clip_grad_norm_(model, clip)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad()
    fp16 = runtime_of(model).loss_scale() is not None
    if runtime_of(model).step_skipped() and not fp16:   # (fp16 may overflow its first scale)
        raise Internal("a clean batch's step was skipped: some value made its gradients "
                       "inf or nan, and nothing refused it")


def config_case(config: dict) -> None:
    """A DeepSpeed config read, its transform applied and one step trained."""
    s = zf.from_deepspeed_config(config, world_size=1)
    train_one_step(s.transform, s.optimizer, s.scheduler, s.gradient_clipping)


# -- the transforms' options ----------------------------------------------------------------
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
WRONG_DTYPES = st.sampled_from([torch.int8, torch.float64, "bf16", None, 16])
SHARDING = {
    "bucket_size": st.sampled_from([1, 1000, 4_000_000]), "sync_module_states": st.booleans(),
    "timeout": st.sampled_from([None, 60, 30.5]), "units": st.sampled_from(
        [None, 1000, ["blocks.0", "blocks.1"], ["nope"]]),
    "on_nonfinite": st.sampled_from(["skip", "raise", "ignore"]),
}
ZERO3 = {"prefetch": st.integers(0, 3), "reshard_after_forward": st.booleans(),
         "persist_below": st.sampled_from([0, 100, 10**6])}
PRECISION = {
    "reduce_dtype": DTYPES | st.none(), "cast_forward_inputs": st.booleans(),
    "loss_scale": st.sampled_from([None, 128.0]), "initial_scale_power": st.integers(0, 20),
    "loss_scale_window": st.integers(1, 1000), "hysteresis": st.integers(1, 4),
    "consecutive_hysteresis": st.booleans(), "min_loss_scale": st.sampled_from([1.0, 0.25]),
}
OFFLOAD = {
    "params": st.booleans(), "units_in_flight": st.integers(1, 3),
    "state_dtype": st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
    "master_dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "seed": st.integers(0, 5), "ratio": st.sampled_from([0.0, 0.5, 1.0, "auto"]),
    "overlap_step": st.booleans(), "device_budget": st.sampled_from([None, 10**9, 0.5]),
    "host_budget": st.sampled_from([None, 0, 10**6]),
    "placement": st.sampled_from([None, {"blocks.0": "device"}, {"<root>": "host"}]),
}


@st.composite
def options(draw, table: dict) -> dict:
    """Some of ``table``'s options, each a right value or (a third of the time) JUNK."""
    names = draw(st.lists(st.sampled_from(sorted(table)), max_size=3, unique=True))
    return {n: draw(table[n] | JUNK if draw(st.integers(0, 2)) else JUNK) for n in names}


@st.composite
def transform_options(draw):
    """``(stage, sharding options, mixed_precision's or None, offload's or None, clip)``;
    an option no transform has (a typo) a tenth of the time."""
    stage = draw(st.integers(1, 3))
    sharding = draw(options({**SHARDING, **(ZERO3 if stage == 3 else {})}))
    if draw(st.integers(0, 9)) == 0:
        sharding["bucket_sise"] = 1
    precision = draw(st.none() | options(PRECISION).flatmap(
        lambda o: (DTYPES | WRONG_DTYPES).map(lambda d: dict(o, param_dtype=d))))
    offload = draw(st.none() | options(OFFLOAD).flatmap(
        lambda o: st.sampled_from(["cpu", "nvme", "disk"]).map(lambda d: dict(o, device=d))))
    return stage, sharding, precision, offload, draw(st.sampled_from([0.0, 1.0]))


def option_names(stage, sharding, precision, offload, clip) -> list[str]:
    """What an error about these options may name: each option, and where the bad value
    is positional (offload's device, mixed_precision's dtype) the call itself."""
    names = list(sharding) + list(precision or {}) + list(offload or {})
    return names + (["offload("] if offload else []) + (["mixed_precision("] if precision else [])


def options_case(stage, sharding, precision, offload, clip, nvme_dir: str) -> None:
    """The parity model under ZeRO-``stage`` with these options, one step."""
    from .loops import zero
    extra = []
    if precision is not None:
        extra.append(zf.mixed_precision(**precision))
    if offload is not None:
        offload = dict(offload)
        path = nvme_dir if offload["device"] == "nvme" else None
        extra.append(zf.offload(offload.pop("device"), path=path, **offload))
    train_one_step(zf.compose(zero(stage, **sharding), *extra), clip=clip)


# -- zerofn train's flags ------------------------------------------------------------------
# A job small enough to build and step in a moment; the drawn flags go after it.
TRAIN_BASE = ["--model", "tiny", "--width", "32", "--heads", "2", "--ffn", "64",
              "--layers", "1", "--context", "16", "--batch", "4", "--steps", "2"]
WORDS = st.sampled_from(["-1", "0", "1", "2", "0.5", "nan", "inf", "abc", "", "auto", "1e9"])
FLAGS = {
    "--stage": st.sampled_from(["1", "2", "3"]), "--precision": st.sampled_from(
        ["fp32", "bf16", "fp16"]), "--offload": st.sampled_from(["none", "cpu", "nvme"]),
    "--nvme-path": st.just("NVME"), "--offload-ratio": st.sampled_from(["0.5", "auto", "1"]),
    "--device-budget": st.sampled_from(["1000000000", "0.5"]),
    "--state-dtype": st.sampled_from(["fp32", "bf16", "int8"]),
    "--master-dtype": st.sampled_from(["fp32", "bf16"]), "--grad-accum": st.sampled_from(
        ["1", "2"]), "--clip": st.sampled_from(["0", "1.0"]), "--batch": st.sampled_from(
        ["2", "4", "8"]), "--lr": st.sampled_from(["1e-3"]), "--steps": st.sampled_from(["2"]),
    "--stop-at": st.sampled_from(["1", "2"]), "--seed": st.sampled_from(["0", "7"]),
    "--log-every": st.sampled_from(["1", "10"]), "--eval-batches": st.sampled_from(["1"]),
    "--keep": st.sampled_from(["1", "3"]), "--timeout": st.sampled_from(["60"]),
    "--on-nonfinite": st.sampled_from(["skip", "raise", "ignore"]),
    "--width": st.sampled_from(["32", "48"]), "--heads": st.sampled_from(["2", "4"]),
    "--ffn": st.sampled_from(["64"]), "--layers": st.sampled_from(["1", "2"]),
    "--context": st.sampled_from(["8", "16"]), "--save-every": st.sampled_from(["1"]),
    "--tp": st.sampled_from(["1", "2"]),   # one rank: --tp 2 must be refused by name
}
SWITCHES = ("--offload-params", "--no-offload-params", "--overlap-step",
            "--activation-checkpointing", "--resume")


@st.composite
def train_flags(draw):
    """``(argv, the flags drawn)``: TRAIN_BASE and one to three flags, each a right value
    or (a third of the time) a wrong word, or a switch."""
    argv, drawn = list(TRAIN_BASE), []
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS) + list(SWITCHES)), min_size=1,
                              max_size=3, unique=True)):
        drawn.append(flag)
        if flag in SWITCHES:
            argv.append(flag)
        else:
            argv += [flag, draw(FLAGS[flag] | WORDS if draw(st.integers(0, 2)) else WORDS)]
    return argv, drawn


def flags_case(argv: list[str], nvme_dir: str) -> None:
    """``zerofn train``'s flags parsed and resolved, its model built, one step."""
    import contextlib
    import io

    from zerofn import train
    from zerofn.train.job import build
    from zerofn.train.loop import train_step
    argv = [nvme_dir if a == "NVME" else a for a in argv]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = train.parse_args(argv)
    except SystemExit:     # argparse's own error, which names the flag
        raise ValueError(said.getvalue()) from None
    job = train.resolve(args, torch.device("cpu"))
    model, opt, sched = build(job, args.seed)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, job.cfg.vocab, (job.batch, job.cfg.context), generator=g)
    train_step(model, opt, sched, (x, x), job, torch.device("cpu"))
