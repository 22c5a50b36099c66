"""Several optimizers over one model, bound as one.

``torch.optim.Muon`` takes 2-D parameters only, so a Muon model has two optimizers: Muon
for the hidden matrices, AdamW for the rest. The transforms take them as a sequence
(``model, (muon, adamw) = zero3(model, (muon, adamw))``) and bind an ``OptimizerChain``
over them: zerofn's parts see one optimizer (its groups are the members' own group dicts,
in order; each parameter's state lives in the member that holds it), while the user keeps
and steps the members, as in plain PyTorch. The step's vote, clip and non-finite verdict
are taken once, at the first member's ``step()`` after backward, which steps every
member's parameters (optimizer.py's [Note: one step for several optimizers]).
"""
from __future__ import annotations

from collections.abc import MutableMapping

import torch


class OptimizerChain(torch.optim.Optimizer):
    """``members`` (torch.optim optimizers) as one optimizer: groups, state and step.

    torch's ``Optimizer.__init__`` is not run: it would copy the groups, and zerofn must
    edit the members' own (the binding puts each parameter's rows in place of it)."""

    def __init__(self, members):
        self.members = tuple(members)
        self.defaults = {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for m in self.members for g in m.param_groups]

    @property
    def state(self) -> "ChainState":
        return ChainState(self.members)

    @state.setter
    def state(self, new) -> None:
        """Each member gets the entries of the parameters it holds (the binding swaps the
        whole state table at once)."""
        for m in self.members:
            held = {id(p) for g in m.param_groups for p in g["params"]}
            table = type(m.state)(m.state.default_factory) \
                if hasattr(m.state, "default_factory") else {}
            table.update((p, v) for p, v in new.items() if id(p) in held)
            m.state = table

    def step(self, closure=None):
        """Each member's own step (without hooks: zerofn's step calls this from within the
        hooked step the loop made)."""
        for m in self.members:
            step_without_hooks(m)

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(m).__name__ for m in self.members)})"


class ChainState(MutableMapping):
    """The members' state tables read as one: a parameter's entry is in the member whose
    groups hold it."""

    def __init__(self, members):
        self.members = members

    def _member(self, p):
        for m in self.members:
            if any(q is p for g in m.param_groups for q in g["params"]):
                return m
        raise KeyError("this tensor is in no optimizer of the chain")

    def __getitem__(self, p):
        for m in self.members:
            if p in m.state:
                return m.state[p]
        return self._member(p).state[p]     # (a defaultdict makes the entry)

    def __setitem__(self, p, value) -> None:
        self._member(p).state[p] = value

    def __delitem__(self, p) -> None:
        for m in self.members:
            if p in m.state:
                del m.state[p]
                return
        raise KeyError(p)

    def __contains__(self, p) -> bool:
        return any(p in m.state for m in self.members)

    def __iter__(self):
        for m in self.members:
            yield from m.state

    def __len__(self) -> int:
        return sum(len(m.state) for m in self.members)

    def clear(self) -> None:
        for m in self.members:
            m.state.clear()


def members_of(optimizer) -> tuple:
    """The optimizers the loop steps: a chain's members, else the optimizer itself."""
    return optimizer.members if isinstance(optimizer, OptimizerChain) else (optimizer,)


def step_without_hooks(optimizer) -> None:
    """The optimizer's own step, without the step hooks anyone registered (torch's
    wrapper runs them around the class's step; ``__wrapped__`` is the step inside): a home
    steps its units with the user's optimizer from within the step zerofn is running, whose
    hooks, the user's and zerofn's, fire once, for the user's own call."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)
