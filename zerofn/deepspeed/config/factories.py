"""DeepSpeed's "optimizer" and "scheduler" sections as factories of torch.optim optimizers
and of DeepSpeed's (or torch's) learning-rate schedulers."""
from __future__ import annotations

import difflib
import inspect

import torch

from ..schedulers import SCHEDULERS
from .settings import OptimizerFactory, SchedulerFactory

NOT_BUILT_OPTIMIZERS = ("lamb", "lion", "muadam", "muadamw", "musgd", "muon", "onebitadam",
                        "zerooneadam", "onebitlamb")


def optimizer_factory(section: dict | None) -> OptimizerFactory | None:
    """DeepSpeed's "optimizer" section as a torch.optim factory.

    Adam and AdamW follow DeepSpeed: "Adam" steps as AdamW (decoupled weight decay) unless
    ``adam_w_mode`` is false; weight decay defaults to 0 (DeepSpeed's fused and CPU Adam)
    unless ``torch_adam`` is true (then torch's own defaults). Other names are
    torch.optim classes (SGD, RMSprop, Adagrad, ...).
    """
    if not section:
        return None
    name, params = section.get("type"), dict(section.get("params") or {})
    if not isinstance(name, str):
        raise ValueError("DeepSpeed config: the optimizer section needs a \"type\" (e.g. AdamW).")
    if "max_grad_norm" in params:
        raise ValueError("DeepSpeed config: optimizer.params.max_grad_norm is not an optimizer "
                         "parameter; use the top-level gradient_clipping.")
    if name.lower() in ("adam", "adamw"):
        cls = _adam_class(name, params)
    elif name.lower() in NOT_BUILT_OPTIMIZERS:
        raise ValueError(f"DeepSpeed config: optimizer {name!r} is DeepSpeed's own; zerofn runs "
                         f"torch.optim optimizers (Adam, AdamW, SGD, ...). Pick one of those, or "
                         f"pass your own optimizer.")
    else:
        cls = _torch_optimizer(name)
    _check_params(cls, params, "optimizer.params", skip=("self", "params"))
    return OptimizerFactory(cls, params)


def _adam_class(name: str, params: dict) -> type:
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = params.pop("adam_w_mode", True)
    params.pop("fp32_optimizer_states", None)    # zerofn's optimizer state is always fp32
    if not params.pop("bias_correction", True):
        raise ValueError("DeepSpeed config: optimizer.params.bias_correction=false has no "
                         "torch.optim equivalent; zerofn's Adam always corrects bias.")
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)     # DeepSpeed's fused/CPU Adam default
    return torch.optim.AdamW if name.lower() == "adamw" or adam_w_mode else torch.optim.Adam


def _torch_optimizer(name: str) -> type:
    classes = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
               if isinstance(getattr(torch.optim, n), type)
               and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)}
    if name.lower() not in classes:
        close = difflib.get_close_matches(name.lower(), classes, n=1)
        raise ValueError(f"DeepSpeed config: optimizer type {name!r} is neither Adam/AdamW nor "
                         f"a torch.optim class" + (f"; did you mean {classes[close[0]].__name__!r}?"
                                                   if close else "."))
    return classes[name.lower()]


def _check_params(fn, params: dict, where: str, skip: tuple) -> None:
    accepted = [p for p in inspect.signature(fn).parameters if p not in skip]
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            raise ValueError(f"DeepSpeed config: {where}.{key} is not a parameter of "
                             f"{fn.__name__} (it takes {accepted})"
                             + (f"; did you mean {close[0]!r}?" if close else "."))


def scheduler_factory(section: dict | None) -> SchedulerFactory | None:
    """DeepSpeed's "scheduler" section: WarmupLR, WarmupDecayLR, WarmupCosineLR with
    DeepSpeed's formulas (``zerofn.deepspeed.schedulers``), or a torch.optim.lr_scheduler
    class by name, as DeepSpeed falls back to."""
    if not section:
        return None
    name, params = section.get("type"), dict(section.get("params") or {})
    cls = SCHEDULERS.get(name) or getattr(torch.optim.lr_scheduler, str(name), None)
    if not isinstance(cls, type):
        known = sorted(SCHEDULERS) + ["OneCycle", "LRRangeTest"]
        hint = ("; zerofn does not build DeepSpeed's OneCycle and LRRangeTest: use "
                "torch.optim.lr_scheduler.OneCycleLR, or pass your own scheduler"
                if name in ("OneCycle", "LRRangeTest") else
                f"; did you mean {difflib.get_close_matches(str(name), known, n=1)}?")
        raise ValueError(f"DeepSpeed config: scheduler type {name!r} is not one of "
                         f"{sorted(SCHEDULERS)} nor a torch.optim.lr_scheduler class{hint}")
    _check_params(cls, params, "scheduler.params", skip=("self", "optimizer"))
    return SchedulerFactory(cls, params)
