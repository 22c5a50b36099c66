""""auto" values filled as Hugging Face's DeepSpeed integration fills them, from its
TrainingArguments' defaults and the model's hidden size."""
from __future__ import annotations

import copy

from .. import keys as K
from .mapping import unprefixed

AUTO = "auto"
# Hugging Face's TrainingArguments defaults, which its integration writes over "auto".
HF_MICRO_BATCH = 8                      # per_device_train_batch_size
HF_FILLS = {
    "gradient_clipping": 1.0,           # max_grad_norm
    "optimizer.params.lr": 5e-5,        # learning_rate
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_num_steps": 1,   # max(1, warmup_steps=0)
    "fp16.enabled": False,
    "bf16.enabled": False,
}


def hidden_size_of(model) -> int | None:
    """The hidden size Hugging Face reads: ``config.hidden_size``, else the largest of
    ``config.hidden_sizes``, else the same on ``config.text_config``."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if hasattr(cfg, "hidden_size"):
            return cfg.hidden_size
        if hasattr(cfg, "hidden_sizes"):
            return max(cfg.hidden_sizes)
    return None


def _hidden_fills(hidden: int) -> dict:
    return {"reduce_bucket_size": hidden * hidden,
            "prefetch_bucket_size": int(0.9 * hidden * hidden),
            "param_persistence_threshold": 10 * hidden}


def resolve_auto(raw: dict, model, stage: int) -> tuple[dict, list[str]]:
    """Replace every "auto" as Hugging Face's integration would with default
    TrainingArguments. Returns the config and "key=value" for each value taken from those
    defaults (batch sizes and hidden-size keys are derived, not defaulted)."""
    config = copy.deepcopy(raw)
    filled = []
    for path, parent, key in list(_auto_values(config)):
        if path in K.BATCH_KEYS:
            del parent[key]      # the batch rule derives it (batch_sizes)
        elif path.startswith("zero_optimization."):
            _fill_zero_auto(parent, key, path, model, stage)
        elif path == "scheduler.params.warmup_max_lr":
            parent[key] = None   # the schedulers' None: the optimizer's own lr
        elif path in HF_FILLS:
            parent[key] = copy.copy(HF_FILLS[path])
            filled.append(f"{path}={parent[key]!r}")
        else:
            raise ValueError(_auto_error(path))
    if any(p in K.BATCH_KEYS for p, _, _ in _auto_values(raw)) and not any(
            k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        config["train_micro_batch_size_per_gpu"] = HF_MICRO_BATCH
        filled.append(f"train_micro_batch_size_per_gpu={HF_MICRO_BATCH}")
    return config, filled


def _auto_values(node, prefix=""):
    for key, value in list(node.items()):
        path = prefix + key
        if isinstance(value, dict):
            yield from _auto_values(value, path + ".")
        elif value == AUTO:
            yield path, node, key


def _fill_zero_auto(zero: dict, key: str, path: str, model, stage: int) -> None:
    name = unprefixed(key)
    fills = ("reduce_bucket_size",) + (("prefetch_bucket_size", "param_persistence_threshold")
                                       if stage == 3 else ())
    if name not in fills:
        if name in ("prefetch_bucket_size", "param_persistence_threshold"):
            del zero[key]        # a ZeRO-3 key under another stage: unused, as in Hugging Face
            return
        raise ValueError(_auto_error(path))
    hidden = hidden_size_of(model) if model is not None else None
    if hidden is None:
        raise ValueError(
            f"DeepSpeed config: {path} is \"auto\", which Hugging Face derives from the model's "
            f"hidden size, but " + ("no model was given" if model is None else
                                    "the model's config has neither hidden_size nor "
                                    "hidden_sizes (nor on its text_config)") +
            f". Pass model= (with a .config), or write a number for {path}.")
    zero[key] = _hidden_fills(hidden)[name]


def _auto_error(path: str) -> str:
    if path.endswith("total_num_steps"):
        return (f"DeepSpeed config: {path} is \"auto\"; Hugging Face fills it from the Trainer's "
                f"number of training steps, which zerofn cannot know. Write the number of "
                f"optimizer steps you will run.")
    return (f"DeepSpeed config: {path} is \"auto\", which zerofn cannot resolve (Hugging Face's "
            f"integration resolves batch sizes, bucket sizes, the persistence threshold, "
            f"clipping, optimizer and scheduler values and fp16/bf16.enabled). Write a value.")
