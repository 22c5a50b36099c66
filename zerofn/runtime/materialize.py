"""Meta-device construction: build a model on ``torch.device("meta")``, and let the
transforms materialize only what this rank keeps.

[Note: meta init] Initialization runs the way ``model.apply(init)`` runs it: children
first, in registration order, one module at a time, with the same RNG stream, on the
rank's device. Before ``init(module)`` runs, the module's own parameters and buffers get
full-size storage there (floating ones filled with NaN, so what no init writes shows).
Every rank computes the same full tensors from the same seed and keeps only its rows: when
the walk finishes a unit's module (all of the unit's modules have then been initialized),
the unit is laid out (master rows, compute shard, offload arena or swap file) and, under
ZeRO-3, its full tensors are dropped. Peak memory is the rank's share plus the units
being initialized: the unit in hand and the root unit, which finishes last because
``init(root)`` may still touch any of its parameters.

A parameter tensor parallelism made a DTensor is initialized whole, as a plain tensor (so
an init writes what it writes in an eager model, which ``parallelize_module`` then
splits), and then replaced by a DTensor holding a copy of this rank's piece of it, before
its unit is laid out.

Parameters keep their identity everywhere but on the meta device: a meta tensor cannot
take host or device storage in place, so each meta parameter is replaced by a new
``nn.Parameter`` (registered in every module holding it, and in the optimizer's groups).
A unit's new parameters are views of one buffer, taken when its first parameter is
materialized and, once the unit is laid out and keeps none of it, given back for the
next unit to reuse:
allocating and freeing each unit's tensors anew fragments the host heap (glibc's grew by
about 60 % of every unit that way, whatever was freed).
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from torch.distributed.tensor import DTensor

from .pool import BufferPool
from ..core.units import Unit, local_of


def meta_state(model: nn.Module) -> bool | None:
    """True if every parameter is on the meta device, False if none is, None if mixed."""
    flags = {p.is_meta for p in model.parameters()}
    return None if len(flags) > 1 else (flags == {True})


def target_device(mesh_device_type: str | None) -> torch.device:
    """Where a meta-built model materializes: the mesh's device, else the current CUDA
    device, else the CPU."""
    kind = mesh_device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def rng_digest(device: torch.device) -> str:
    """A fingerprint of the generators an init on ``device`` draws from: ranks that agree on
    it compute the same weights, so none needs another's."""
    state = [torch.get_rng_state()]
    if device.type == "cuda":
        state.append(torch.cuda.get_rng_state(device))
    return hashlib.sha256(b"".join(s.numpy().tobytes() for s in state)).hexdigest()


def reset_parameters(module: nn.Module) -> None:
    """The default ``init``: the module's own ``reset_parameters()``, where it has one."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


class Materializer:
    """Walks the model as ``model.apply`` does, materializing and initializing each module,
    and hands every unit to ``lay_out(unit)`` once its module has been initialized."""

    def __init__(self, model: nn.Module, units: list[Unit], init, device: torch.device):
        self.model, self.units, self.device = model, units, device
        self.init = init or reset_parameters
        self.new_of: dict[nn.Parameter, nn.Parameter] = {}   # meta param -> materialized
        self._slot_of = {s.param: s for u in units for s in u.slots}   # meta and new params
        self._unit_of = {s: u for u in units for s in u.slots}
        self._flat: dict[Unit, tuple[torch.Tensor, list[int]]] = {}   # unit -> (buffer, [used])
        self._buffers_pool = BufferPool()      # dropped with the materializer
        self._placed: dict[tuple[nn.Module, str], nn.Parameter] = {}   # (owner, attr) -> new
        self._buffers: dict[tuple[nn.Module, str], torch.Tensor] = {}   # (module, name) -> meta
        self._versions: dict[int, int] = {}   # id of a non-floating tensor -> its _version
        self._units_at: dict[nn.Module, list[Unit]] = {}
        for u in units:
            self._units_at.setdefault(u.module, []).append(u)
        self._visits_left: dict[nn.Module, int] = {}
        self._count_visits(model)
        self.problems: list[str] = []

    def run(self, lay_out) -> None:
        """Materialize, initialize and lay out everything; problems land in ``problems``."""
        with torch.no_grad():
            try:
                self._visit(self.model, lay_out)
            except Exception as e:   # agreed on across ranks by the caller, then raised
                self.problems.append(f"initializing the meta-built model raised {e!r}.")
                return
        self._check_buffers()

    def undo(self) -> None:
        """Put the meta tensors back in every module, after a failed set-up."""
        for meta in self.new_of:
            for module, name in self._slot_of[meta].owners:
                module._parameters[name] = meta
            self._slot_of[meta].param = meta
        for (module, name), meta in self._buffers.items():
            module._buffers[name] = meta

    def _visit(self, module: nn.Module, lay_out) -> None:
        for child in module.children():
            self._visit(child, lay_out)
        self._materialize(module)
        self.init(module)
        self._adopt_assigned(module)
        self._visits_left[module] -= 1
        if self._visits_left[module]:
            return   # a module under two parents is initialized again: lay out after the last
        for unit in self._units_at.pop(module, ()):
            self._check_params(unit)
            self._split(unit)
            lay_out(unit)
            self._release(unit)

    def _count_visits(self, module: nn.Module) -> None:
        """How often the walk (``model.apply``'s) reaches each module: once per parent."""
        self._visits_left[module] = self._visits_left.get(module, 0) + 1
        for child in module.children():
            self._count_visits(child)

    def _materialize(self, module: nn.Module) -> None:
        for pname, p in module._parameters.items():
            if p is None or not p.is_meta or p in self.new_of:
                continue
            slot = self._slot_of[p]
            unit = self._unit_of[slot]
            new = nn.Parameter(self._view(unit, slot.global_shape) if slot.spec is None
                               else self._empty(slot.global_shape, unit.dtype),
                               requires_grad=p.requires_grad)
            if not (new.is_floating_point() or new.is_complex()):
                self._versions[id(new)] = new._version
            self.new_of[p] = new
            slot.param = new
            self._slot_of[new] = slot
            for owner, attr in slot.owners:
                owner._parameters[attr] = new
                self._placed[(owner, attr)] = new
        for bname, b in module._buffers.items():
            if b is not None and b.is_meta:
                self._buffers[(module, bname)] = b
                module._buffers[bname] = self._empty(b.shape, b.dtype)

    def _split(self, unit: Unit) -> None:
        """Each tensor-parallel parameter of ``unit``, initialized whole, becomes the DTensor
        of this rank's piece (a copy: the whole goes back with the unit's buffer)."""
        for s in unit.slots:
            if s.spec is None or isinstance(s.param, DTensor):
                continue
            whole = s.param
            new = nn.Parameter(DTensor(s.piece_of(whole.detach()).clone(), s.spec,
                                       requires_grad=whole.requires_grad),
                               requires_grad=whole.requires_grad)
            meta = next(m for m, n in self.new_of.items() if n is whole)
            self.new_of[meta] = new
            s.param = new
            self._slot_of[new] = s
            for owner, attr in s.owners:
                owner._parameters[attr] = new
                self._placed[(owner, attr)] = new

    def _release(self, unit: Unit) -> None:
        """The unit's buffer goes back for reuse once no parameter lives in it (ZeRO-3 keeps
        only rows, mixed precision casts); ZeRO-1/2 keep their full parameters in it."""
        flat = self._flat.pop(unit, (None,))[0]
        ptr = flat.untyped_storage().data_ptr() if flat is not None else None
        if ptr is not None and all(local_of(s.param).untyped_storage().data_ptr() != ptr
                                   for s in unit.slots):
            self._buffers_pool.give(flat)

    def _view(self, unit: Unit, shape: torch.Size) -> torch.Tensor:
        """Storage for one of ``unit``'s plain parameters, whole: the next piece of the unit's
        buffer. (A tensor-parallel one's whole gets its own, freed once its piece is taken:
        at ZeRO-1/2 the plain ones keep the buffer alive.)"""
        if unit not in self._flat:
            total = sum(s.global_shape.numel() for s in unit.slots if s.spec is None)
            flat = self._buffers_pool.take(total, unit.dtype, self.device)
            self._flat[unit] = (self._poison(flat), [0])
        flat, used = self._flat[unit]
        view = flat[used[0]:used[0] + shape.numel()].view(shape)
        used[0] += shape.numel()
        return view

    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self._poison(torch.empty(shape, dtype=dtype, device=self.device))

    def _poison(self, t: torch.Tensor) -> torch.Tensor:
        """NaN where no init has written yet; non-floating tensors are watched by version."""
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            self._versions[id(t)] = t._version
        return t

    def _adopt_assigned(self, module: nn.Module) -> None:
        """An init that assigned a new parameter (``m.weight = nn.Parameter(...)``) instead of
        writing the materialized one: its values move into the parameter zerofn tracks."""
        for pname, p in module._parameters.items():
            mine = self._placed.get((module, pname))
            if mine is not None and p is not mine and p is not None and not p.is_meta:
                mine.copy_(p.detach())
                for owner, attr in self._slot_of[mine].owners:
                    owner._parameters[attr] = mine

    def _check_params(self, unit: Unit) -> None:
        for s in unit.slots:
            if not self._written(s.param):
                self.problems.append(
                    f"parameter {s.fqn!r} was not (fully) initialized: no init wrote it (or "
                    "left NaN in it). Pass init= a function that initializes it (it is "
                    "called on every module, children first, like model.apply), or give its "
                    "module a reset_parameters().")

    def _check_buffers(self) -> None:
        names = {m: n for n, m in self.model.named_modules(remove_duplicate=False)}
        for (module, bname), _ in self._buffers.items():
            b = module._buffers.get(bname)
            fqn = f"{names[module]}.{bname}" if names[module] else bname
            if b is None:
                continue
            if b.is_meta or not self._written(b):
                self.problems.append(
                    f"buffer {fqn!r} was left uninitialized on the meta device: buffers built "
                    "in __init__ hold no values under torch.device('meta'); have init= "
                    "recompute it (Hugging Face's model._init_weights does for rotary "
                    "embeddings).")

    def _written(self, t: torch.Tensor) -> bool:
        if t.is_floating_point() or t.is_complex():
            # max propagates NaN, and unlike isnan().any() (or a widening sum) it allocates
            # nothing of t's size.
            return not t.numel() or not bool(
                (torch.view_as_real(t) if t.is_complex() else t).max().isnan())
        before = self._versions.get(id(t))
        return before is None or t._version != before
