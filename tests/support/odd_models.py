"""Odd models for the property tests, built from plain JSON-like specs.

A spec describes a model that stresses zerofn's layout: parameters with zero, one or few
rows (fewer than the world), 3-D and 0-dim parameters, tied parameters, the same module
under two parents, frozen and never-used parameters, parameters used twice in a forward
or only on some steps, buffers (persistent, non-persistent, integer), nested ModuleLists,
and blocks of another dtype. ``OddNet(spec)`` builds it (on any device, meta included),
``odd_init`` initializes it like ``model.apply(odd_init)``, and ``expected_units`` says, from
the documented rules alone, which unit each parameter must land in.

Block spec (a leaf): ``{"kind": "block", "rows": r, "dtype": "fp32"|"fp64"|"bf16",
"bias": bool, "gain": bool, "thin": n|None, "cube": r|None, "spare": r|None,
"scalar": bool, "lin": None|"bias"|"nobias", "buffers": bool, "frozen": [names],
"branch": None|[period, phase, "block"|"dense"]}``; a stack: ``{"kind": "stack",
"children": [specs], "gain": bool}``. Model spec: ``{"blocks": [specs], "tie_io": bool,
"one": bool, "empty": bool, "scalar": bool, "reuse": [paths], "ties": [[src, dst]]}``.
"""
from __future__ import annotations

import torch
from torch import nn

WIDTH = 6   # features: not divisible by 4, so rows fall unevenly at world 4
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


class OddBlock(nn.Module):
    """``(B, WIDTH) -> (B, WIDTH)``; which parameters exist and how they are used follows
    the spec (see the module docstring)."""

    def __init__(self, spec: dict):
        super().__init__()
        dt = self.dtype = DTYPES[spec["dtype"]]
        rows = spec["rows"]
        self.branch = spec.get("branch")
        self.w1 = nn.Parameter(torch.empty(rows, WIDTH, dtype=dt))
        self.w2 = nn.Parameter(torch.empty(rows, WIDTH, dtype=dt))
        optional = {"b": (spec.get("bias"), (rows,)), "gain": (spec.get("gain"), (WIDTH,)),
                    "thin": (spec.get("thin") is not None, (spec.get("thin"),)),
                    "cube": (spec.get("cube") is not None, (spec.get("cube"), 2, 3)),
                    "spare": (spec.get("spare") is not None, (spec.get("spare"), WIDTH)),
                    "scalar": (spec.get("scalar"), ())}
        for name, (present, shape) in optional.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dt)) if present else None)
        self.lin = nn.Linear(WIDTH, WIDTH, bias=spec["lin"] == "bias", dtype=dt) \
            if spec.get("lin") else None
        self.perm_order = [(3 * i + 1) % WIDTH for i in range(WIDTH)]
        if spec.get("buffers"):
            self.register_buffer("scale", torch.linspace(0.8, 1.2, WIDTH, dtype=dt))
            self.register_buffer("shift", torch.linspace(-0.1, 0.1, WIDTH, dtype=dt),
                                 persistent=False)
            self.register_buffer("perm", torch.tensor(self.perm_order))
        for name in spec.get("frozen", ()):
            self.get_parameter(name).requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        on = self.branch is None or step % self.branch[0] == self.branch[1]
        if not on and self.branch[2] == "block":
            return x                      # the whole block sits this step out
        y = x.to(self.dtype)
        if on:                            # "dense": only w1, w2 and b sit it out
            h = y @ self.w1.T
            if self.b is not None:
                h = h + self.b
            y = y + 0.5 * torch.tanh(h) @ self.w2
        if self.gain is not None:
            y = y * self.gain.to(y.dtype)     # a tied gain may be of another dtype
        if self.thin is not None:
            y = y * (1 + 0.1 * self.thin.sum())
        if self.cube is not None:         # used twice in one forward
            c = self.cube.reshape(-1, WIDTH)
            y = y + 0.2 * torch.tanh(y @ c.T) @ c
        if self.scalar is not None:
            y = y * (1 + 0.1 * self.scalar)
        if self.lin is not None:          # a module called twice in one forward
            y = y + 0.3 * self.lin(torch.tanh(self.lin(y)))
        if hasattr(self, "perm"):
            y = y[:, self.perm] * self.scale + self.shift
        return y.to(torch.float32)


class Stack(nn.Module):
    """Children in a nested ModuleList, run in order, then an optional gain."""

    def __init__(self, spec: dict):
        super().__init__()
        self.subs = nn.ModuleList(make_block(c) for c in spec["children"])
        self.gain = nn.Parameter(torch.empty(WIDTH)) if spec.get("gain") else None

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for sub in self.subs:
            x = sub(x, step)
        return x * self.gain if self.gain is not None else x


def make_block(spec: dict) -> nn.Module:
    return Stack(spec) if spec["kind"] == "stack" else OddBlock(spec)


class OddNet(nn.Module):
    """``loss = OddNet(spec)(x, y, step)``: input and output projections around the blocks,
    then the modules in ``reuse`` (each also held elsewhere: the same module under two
    parents) run a second time; the loss is a mean over the batch, so the mean of the
    ranks' losses is the global batch's."""

    def __init__(self, spec: dict):
        super().__init__()
        self.inp = nn.Parameter(torch.empty(WIDTH, WIDTH))
        self.blocks = nn.ModuleList(make_block(b) for b in spec["blocks"])
        self.out = self.inp if spec.get("tie_io") else nn.Parameter(torch.empty(WIDTH, WIDTH))
        self.one = nn.Parameter(torch.empty(1)) if spec.get("one") else None
        self.empty = nn.Parameter(torch.empty(0, WIDTH)) if spec.get("empty") else None
        self.scalar = nn.Parameter(torch.empty(())) if spec.get("scalar") else None
        self.reuse = nn.ModuleList(self.get_submodule(p) for p in spec.get("reuse", ()))
        for src, dst in spec.get("ties", ()):
            self.get_submodule(dst).gain = self.get_submodule(src).gain

    def forward(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        h = x @ self.inp.T
        for block in list(self.blocks) + list(self.reuse):
            h = block(h, step)
        if self.one is not None:
            h = h * self.one
        if self.empty is not None:
            h = h + (h @ self.empty.T).sum()
        if self.scalar is not None:
            h = h * (1 + 0.1 * self.scalar)
        return ((h @ self.out.T - y) ** 2).mean()


@torch.no_grad()
def odd_init(m: nn.Module) -> None:
    """Writes every parameter and buffer a module holds itself (``model.apply`` style)."""
    if isinstance(m, nn.Linear):
        m.weight.normal_(0, 0.3)
        if m.bias is not None:
            m.bias.uniform_(-0.1, 0.1)
        return
    for name, p in m.named_parameters(recurse=False):
        if name in ("gain", "one"):
            p.uniform_(0.8, 1.2)
        else:
            p.normal_(0, 0.4)
    if isinstance(m, OddBlock) and hasattr(m, "perm"):
        m.scale.copy_(torch.linspace(0.8, 1.2, WIDTH))
        m.shift.copy_(torch.linspace(-0.1, 0.1, WIDTH))
        m.perm.copy_(torch.tensor(m.perm_order))


def block_paths(spec: dict) -> list[tuple[str, dict]]:
    """``(module path, block spec)`` of every block and stack in a model spec."""
    out = []

    def walk(prefix: str, blocks: list) -> None:
        for i, b in enumerate(blocks):
            out.append((f"{prefix}.{i}", b))
            if b["kind"] == "stack":
                walk(f"{prefix}.{i}.subs", b["children"])

    walk("blocks", spec["blocks"])
    return out


def expected_units(model: nn.Module, policy, persist_below: int = 0) -> dict:
    """``{fqn: unit module, or "<persistent>"}`` from the documented rules alone: units are
    every ModuleList child no other such child holds (``None``), the listed modules, or (an
    int) modules in post-order once they hold that many not-yet-claimed elements, never a
    container; a parameter belongs to the innermost unit holding it, to the root where two
    units hold it, and to the persistent unit (ZeRO-3) where it has fewer than
    ``persist_below`` elements."""
    chosen = _policy_modules(model, policy)
    unit_of: dict[nn.Parameter, nn.Module] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        parts = path.split(".") if path else []
        unit = next((m for i in range(len(parts), 0, -1)
                     for m in [model.get_submodule(".".join(parts[:i]))]
                     if any(m is c for c in chosen)), model)
        for p in module.parameters(recurse=False):
            unit_of[p] = unit if unit_of.get(p, unit) is unit else model
    return {n: "<persistent>" if p.numel() < persist_below else unit_of[p]
            for n, p in model.named_parameters()}


def runs(module: nn.Module) -> bool:
    """Containers (ModuleList) have no forward: they are never units."""
    return type(module).forward is not nn.Module.forward


def _policy_modules(model: nn.Module, policy) -> list[nn.Module]:
    if policy is None:     # ModuleList children reached through no other such child
        def list_child(parts):
            return len(parts) > 0 and runs(model.get_submodule(".".join(parts))) and \
                isinstance(model.get_submodule(".".join(parts[:-1])), nn.ModuleList)
        chosen = []
        for path, m in model.named_modules(remove_duplicate=False):
            parts = path.split(".") if path else []
            if list_child(parts) and not any(list_child(parts[:i]) for i in range(len(parts))) \
                    and not any(m is c for c in chosen):
                chosen.append(m)
        return chosen
    if isinstance(policy, int):
        claimed, chosen = set(), []

        def visit(m: nn.Module) -> None:
            for c in m.children():
                visit(c)
            fresh = [p for p in m.parameters() if p not in claimed]
            if m is not model and runs(m) and sum(p.numel() for p in fresh) >= policy:
                chosen.append(m)
                claimed.update(fresh)

        visit(model)
        return chosen
    return [model.get_submodule(x) if isinstance(x, str) else x for x in policy]
