"""The user's optimizer, bound to step this rank's shards.

Binding keeps the optimizer's class, hyperparameters and param groups; each parameter in
its groups is replaced, in place and in order, by the tensor holding this rank's rows of
it. Every optimizer torch.optim ships that updates each element from that element alone
(Adam, AdamW, SGD, RMSprop, Adagrad, ...) then computes exactly what it computes on the
full tensors. torch's own step hooks (``register_step_pre_hook``/``post_hook``) run
zerofn's step around the optimizer's: no method is set on the instance, so
``optimizer.step`` stays torch's (LR schedulers check it) and ``zero_grad`` is torch's.

[Note: zero_grad without a patch] After a reducing backward, and after a step, each bound
parameter's ``.grad`` is a marker (visible.py): torch's ``zero_grad`` sets it to None, or
zeroes it, as it does any gradient, and the runtime reads that as the loop's
``zero_grad`` (at the step, and at the next forward). During zerofn's own step the
markers are taken off, so torch's step finds no gradient and steps nothing twice.

[Note: finding the optimizer] A transform given the optimizer binds it at set-up. One given
none (FSDP2's order: shard, then build the optimizer over ``model.parameters()``) leaves
the runtime unbound; the first optimizer whose step holds its parameters is bound then, by
a step pre-hook torch.optim runs for every optimizer (``finder.py``), agreed on every rank
before the step; zerofn's functions given an optimizer (state dicts, checkpoints) bind it
as well. A later optimizer over the same parameters takes them over with fresh state, as a
new torch.optim optimizer starts fresh; the one it replaced is retired (stepping it
raises).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .chain import members_of, step_without_hooks
from .owned import owned_problems


# These step through a closure (line searches) or sparse rows: neither a shard's step nor
# an owner's (owned.py steps whole-tensor optimizers such as Muon and Adafactor).
REFUSED = ("LBFGS", "SparseAdam")


def check_optimizer(optimizer, slot_of: dict) -> list[str]:
    """Problems with the optimizer (or each optimizer of a chain), as messages (raised by
    the caller on every rank). ``slot_of``: each tensor that stands for a model parameter
    (its whole parameter, ZeRO-3's registered DTensor) -> its slot."""
    name = type(optimizer).__name__
    problems = [f"{type(m).__name__} steps through a closure or sparse rows, which zerofn "
                "cannot give it on shards or on one owner; use AdamW, SGD, Muon or Adafactor."
                for m in members_of(optimizer) if type(m).__name__ in REFUSED]
    problems += owned_problems(optimizer, slot_of)
    seen = set()
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            slot = slot_of.get(p)
            if slot is None:
                problems.append(f"param group {i} of {name} holds a tensor of shape "
                                f"{tuple(p.shape)} that is not a parameter of the model; "
                                "build the optimizer over model.parameters().")
            elif slot in seen:
                problems.append(f"{name} holds parameter {slot.fqn!r} twice; give each "
                                "parameter to one param group once.")
            seen.add(slot)
    return problems


def signature(optimizer) -> list[str]:
    """What every rank's optimizer must agree on: its classes and its groups' sizes."""
    return [type(m).__name__ for m in members_of(optimizer)] + [f"group {i}: {len(g['params'])} params"
                                         for i, g in enumerate(optimizer.param_groups)]


class OptimizerBinding:
    """Everything zerofn changes on the user's optimizer, in one place, with its exact
    inverse (``restore``): shard params in its groups (state it holds cut to them), step
    hooks around torch's own step, and state-dict hooks for fp16's loss scale.

    Args:
        slot_of: each tensor that stands for a model parameter -> its slot (whose
            ``opt_param`` in the runtime's table the optimizer steps instead).
        stepper: whose ``before_step`` and ``after_step`` the step hooks run (stepper.py).
        ctx: the runtime's context: its observers, told when a step begins (their guard
            wraps zerofn's part of it), and its parameter table (param_table.py).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, slot_of: dict, stepper, ctx,
                 whole: set = frozenset()):
        self.optimizer = optimizer
        table = ctx.table
        self.slots = [[slot_of[p] for p in g["params"]] for g in optimizer.param_groups]
        self._swap({p: table[slot_of[p]].opt_param for g in optimizer.param_groups
                    for p in g["params"]}, lambda p, v: _shard_state(slot_of[p], v))
        self.members = members_of(optimizer)
        self._handles = self._step_hooks(stepper, ctx.observers)
        # (owned.py: a whole-tensor optimizer's state is made whole, on the owner, at its step)
        self._trainable = {table[s].opt_param for g in self.slots for s in g
                           if s.requires_grad and s not in whole}
        self.stepped = False      # a step or a load ran: the state is torch.optim's own now
        self._made: set = set()   # params init_state gave state to (no step ever made it)
        scaler = stepper.scaler
        if scaler is not None:
            self._handles += [
                self.members[0].register_state_dict_post_hook(
                    lambda opt, sd: {**sd, SCALER_KEY: scaler.state_dict()}),
                self.members[0].register_load_state_dict_pre_hook(
                    lambda opt, sd: _load_scaler(scaler, sd)),
            ]

    def _step_hooks(self, stepper, observers) -> list:
        """[Note: one step for several optimizers] The first member's ``step()`` after
        backward runs zerofn's step, which steps every member's parameters (one vote, one
        clip, one non-finite verdict); the other members' steps that follow find no
        gradient (their markers are off meanwhile) and step nothing. A member stepped
        again before the others begins the next step."""
        before, after = observers.guard(stepper.before_step), observers.guard(stepper.after_step)
        done: set = set()     # the members stepped since zerofn's step ran

        def pre_hook(opt, args, kwargs):
            if opt in done:
                done.clear()
            if done:
                stepper.reducer.visible.unmark()
                return
            observers.step_begin()
            self.stepped = True
            before()

        def post_hook(opt, args, kwargs):
            first = not done
            done.add(opt)
            if first:
                after()
            else:
                stepper.reducer.visible.mark()
            if len(done) == len(self.members):
                done.clear()

        return [h for m in self.members for h in (m.register_step_pre_hook(pre_hook),
                                                  m.register_step_post_hook(post_hook))]

    def holds(self, slot) -> bool:
        return any(slot in g for g in self.slots)

    def _swap(self, new_of: dict, convert) -> None:
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
        """Put the model's parameters back in the groups (each slot's ``param``: after the
        runtime's restore, what the model registers), with full optimizer state from
        ``full_state_of``."""
        self._remove_hooks()
        new_of = {}
        for group, slots in zip(self.optimizer.param_groups, self.slots):
            new_of.update((p, s.param) for p, s in zip(group["params"], slots))
        self._swap(new_of, full_state_of)

    def retire(self, param_of) -> None:
        """Another optimizer took the parameters over: the model's parameters
        (``param_of(slot)``) go back in the groups, without state (its tensors were the
        homes', which the new optimizer starts afresh)."""
        self._remove_hooks()
        for group, slots in zip(self.optimizer.param_groups, self.slots):
            group["params"][:] = [param_of(s) for s in slots]
        self.optimizer.state.clear()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

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
        grads = {p: p.grad for group in self.optimizer.param_groups for p in group["params"]}
        for p in grads:     # (markers off: only the bare ones step)
            p.grad = torch.zeros_like(p) if p in self._made else None
        try:
            step_without_hooks(self.optimizer)
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr
            for p, g in grads.items():
                p.grad = g

    def forget_made_state(self, loaded: set) -> None:
        """After a load: state ``init_state`` made for a parameter the checkpoint holds none
        for goes, so the optimizer holds what was saved, as ``load_state_dict`` leaves it
        (an Adam step count of 1 would otherwise bias that parameter's first real step).
        The state is the checkpoint's now: none is made up again."""
        self.stepped = True
        for p in self._made - loaded:
            self.optimizer.state.pop(p, None)
        self._made.clear()


SCALER_KEY = "zerofn_loss_scaler"


def _load_scaler(scaler, state_dict: dict) -> dict:
    if SCALER_KEY not in state_dict:
        raise KeyError(f"This optimizer scales fp16 losses, but the state dict has no "
                       f"{SCALER_KEY!r}; it was saved without mixed_precision(torch.float16).")
    state_dict = dict(state_dict)
    scaler.load_state_dict(state_dict.pop(SCALER_KEY))
    return state_dict


def _shard_state(slot, value):
    """Existing state of a parameter, cut to this rank's rows: of a whole parameter, its
    rows; of ZeRO-3's registered DTensor (an optimizer built after sharding), its local
    rows."""
    if isinstance(value, DTensor) and value.to_local().shape == slot.local_shape:
        return value.to_local().clone()
    if torch.is_tensor(value) and value.dim() > 0 and value.shape == slot.shape:
        return slot.rows_of(value).clone()
    return value
