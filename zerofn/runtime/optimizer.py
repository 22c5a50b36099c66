"""The user's optimizer, rewired to step this rank's shards.

The optimizer keeps its class, hyperparameters and param groups; each parameter in its
groups is replaced, in place and in order, by the tensor holding this rank's rows of it.
Every optimizer torch.optim ships that updates each element from that element alone
(Adam, AdamW, SGD, RMSprop, Adagrad, ...) then computes exactly what it computes on the
full tensors. Step hooks attach the reduced gradient shards before the step and share
the updated rows after it.
"""
from __future__ import annotations

import types

import torch


# These mix elements across a tensor (factored moments, line searches, sparse rows), so
# stepping a shard is not stepping the whole: refuse them.
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


def check_optimizer(optimizer, slot_of: dict) -> list[str]:
    """Problems with the optimizer, as messages (raised by the caller on every rank)."""
    problems = []
    if type(optimizer).__name__ in NOT_ELEMENTWISE:
        problems.append(
            f"{type(optimizer).__name__} does not update each element independently, so a "
            "sharded step would differ from the unsharded one; use an elementwise optimizer "
            "such as AdamW or SGD.")
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in slot_of:
                problems.append(f"param group {i} holds a tensor of shape {tuple(p.shape)} that "
                                "is not a parameter of the model; build the optimizer over "
                                "model.parameters().")
    return problems


class OptimizerWiring:
    """Everything zerofn changes on the user's optimizer, in one place, with its exact
    inverse (``restore``): shard params in its groups, step hooks, and on the instance a
    ``step`` that announces itself and runs under the guard, a ``zero_grad`` that clears
    the gradient shards, and ``scale`` (fp16 loss scaling).

    Args:
        slot_of: each of the model's parameters -> its slot (whose ``opt_param`` the
            optimizer steps instead).
        stepper: whose ``before_step``, ``after_step``, ``zero_grad`` and loss ``scaler``
            the optimizer's step, zero_grad and scale call (stepping.py).
        observers: told when a step begins; their guard wraps it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, slot_of: dict, stepper, observers):
        self.optimizer = optimizer
        self.originals = [list(g["params"]) for g in optimizer.param_groups]
        self._swap_params({p: slot_of[p].opt_param for g in self.originals for p in g},
                          lambda p, v: _shard_state(slot_of[p], v))
        self._handles = [optimizer.register_step_pre_hook(lambda *_: stepper.before_step()),
                         optimizer.register_step_post_hook(lambda *_: stepper.after_step())]
        self._trainable = {slot_of[p].opt_param for g in self.originals for p in g if p.requires_grad}
        self.stepped = False      # a step or a load ran: the state is torch.optim's own now
        self._made: set = set()   # params init_state gave state to (no step ever made it)
        plain_zero_grad = optimizer.zero_grad

        def sharded_zero_grad(set_to_none: bool = True) -> None:
            plain_zero_grad(set_to_none)
            stepper.zero_grad()

        optimizer.zero_grad = sharded_zero_grad
        own_step = optimizer.__dict__.get("step")
        step = observers.guard(optimizer.step)

        def stepping(opt, *args, **kwargs):
            observers.step_begin()
            self.stepped = True
            return step(*args, **kwargs)

        # A bound method, as torch's LR schedulers expect to find (they rebind its function).
        optimizer.step = types.MethodType(stepping, optimizer)
        self._step = (own_step, optimizer.step)
        # fp32 before scaling, as DeepSpeed does: an fp16 loss times 2**16 would itself be inf.
        scaler = stepper.scaler
        optimizer.scale = (lambda loss: loss) if scaler is None else \
            (lambda loss: loss.float() * scaler.scale)
        if scaler is not None:
            self._handles += [
                optimizer.register_state_dict_post_hook(
                    lambda opt, sd: {**sd, SCALER_KEY: scaler.state_dict()}),
                optimizer.register_load_state_dict_pre_hook(
                    lambda opt, sd: _load_scaler(scaler, sd)),
            ]

    def _swap_params(self, new_of: dict, convert) -> None:
        old_state = self.optimizer.state
        state = type(old_state)(old_state.default_factory) if hasattr(old_state, "default_factory") \
            else {}
        for group in self.optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                group["params"][i] = new_of[p]
                if p in old_state:
                    state[new_of[p]] = {k: convert(p, v) for k, v in old_state[p].items()}
        self.optimizer.state = state

    def restore(self, full_state_of) -> None:
        """Put the original parameters back, with full optimizer state from ``full_state_of``."""
        for h in self._handles:
            h.remove()
        del self.optimizer.zero_grad
        del self.optimizer.scale
        own, ours = self._step
        if self.optimizer.__dict__.get("step") == ours:   # (else wrapped again since: ours
            if own is None:                                # stays, passing calls through)
                del self.optimizer.step
            else:
                self.optimizer.step = own
        new_of = {}
        for group, originals in zip(self.optimizer.param_groups, self.originals):
            new_of.update(zip(group["params"], originals))
        self._swap_params(new_of, full_state_of)

    def init_state(self) -> None:
        """Before the first step, create the optimizer's state where a parameter has none
        yet (a home that lets the user's optimizer keep it makes it at the first step) with
        a zero-gradient, zero-lr step, as torch's DCP helpers do, so a checkpoint load has
        tensors to load into. After a step, a parameter without state is one torch.optim
        never stepped (it never had a gradient): it stays without, as in plain PyTorch."""
        bare = [p for group in self.optimizer.param_groups for p in group["params"]
                if p in self._trainable and p not in self.optimizer.state]
        if self.stepped or not bare:
            return
        self._made.update(bare)
        lrs = []
        for group in self.optimizer.param_groups:
            lrs.append(group.get("lr"))
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        for p in bare:
            p.grad = torch.zeros_like(p)
        try:
            step_without_hooks(self.optimizer)
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr
            for p in bare:
                p.grad = None

    def forget_made_state(self, loaded: set) -> None:
        """After a load: state ``init_state`` made for a parameter the checkpoint holds none
        for goes, so the optimizer holds what was saved, as ``load_state_dict`` leaves it
        (an Adam step count of 1 would otherwise bias that parameter's first real step).
        The state is the checkpoint's now: none is made up again."""
        self.stepped = True
        for p in self._made - loaded:
            self.optimizer.state.pop(p, None)
        self._made.clear()


def step_without_hooks(optimizer) -> None:
    """The optimizer's own step, without the step hooks anyone registered (torch's
    wrapper runs them around the class's step; ``__wrapped__`` is the step inside): a home
    steps its units with the user's optimizer from within the step zerofn is running, whose
    hooks, the user's and zerofn's, fire once, for the user's own call."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


SCALER_KEY = "zerofn_loss_scaler"


def _load_scaler(scaler, state_dict: dict) -> dict:
    if SCALER_KEY not in state_dict:
        raise KeyError(f"This optimizer scales fp16 losses, but the state dict has no "
                       f"{SCALER_KEY!r}; it was saved without mixed_precision(torch.float16).")
    state_dict = dict(state_dict)
    scaler.load_state_dict(state_dict.pop(SCALER_KEY))
    return state_dict


def _shard_state(slot, value):
    """Existing state of a full parameter, cut to this rank's rows."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape == slot.shape:
        return slot.rows_of(value).clone()
    return value
