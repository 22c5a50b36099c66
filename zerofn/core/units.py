"""Units: groups of parameters gathered and reduced together, and their shard layout.

[Note: layout] Every parameter is split along dim 0 the way ``torch.chunk(world)`` splits
it: ``chunk = ceil(rows / world)`` rows per rank, trailing ranks shorter or empty. The
local pieces of one unit lie back to back in one flat buffer of ``shard_numel`` elements
(each piece padded to ``chunk`` rows, then to a multiple of ``SLOT_ALIGN`` elements), so one
all-gather or reduce-scatter moves a whole unit. Gathered (rank-major) buffers are viewed
as ``(world, shard_numel)``; a parameter's columns in that view are
``[offset, offset + chunk * inner)``.

[Note: parameters another parallelism split] A parameter that tensor or expert parallelism
made a DTensor (``parallelize_module``) is sharded here as FSDP2 shards it: its local
tensor, the piece this rank holds, is what the layout above splits along dim 0 over the
data-parallel ranks. ``ParamSlot.spec`` keeps the parameter's own DTensor spec; the
registered parameter, its gradient and its optimizer state are DTensors on the
data-parallel mesh concatenated with the parameter's own, with FSDP2's placements:
``Shard(0)`` over the data-parallel ranks, ``_StridedShard(0, split_factor)`` where the
parameter's own placements already split dim 0 (the data-parallel rows interleave with
them), then the parameter's own placements.

[Note: a module's own group] ``groups=`` gives some modules (a mixture's experts, which
expert parallelism already split: each rank runs its own) a data-parallel group of their
own, as FSDP2 takes a mesh per module: such a module is a unit whose ``group`` names it,
laid out over that group's ranks (``world`` and ``rank`` above are that group's), and its
slots' ``dp`` is the mesh and placements their DTensors are declared on, in place of the
runtime's. Its parameters are never replicated by ``persist_below``: their rows differ
from one expert-parallel rank to the next.

[Note: aligned slots] A gathered parameter is a view at ``world * offset`` of its unit's
buffer, and a shard one at ``offset``. Packed tightly, one parameter of odd size would
leave every later one in the unit at an odd address: CUDA's grouped GEMM
(``torch._grouped_mm``, transformers' mixture-of-experts layers) refuses a weight whose
address is not a multiple of 16 bytes, and vectorized kernels fall back to scalar loads.
FSDP2 gives each gathered parameter an allocation of its own; here each slot starts at a
multiple of 16 elements, 16 bytes or more in any dtype, at the cost of at most 15 padding
elements a parameter.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard


SLOT_ALIGN = 16     # elements: [Note: aligned slots]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor zerofn lays out, gathers and reduces for ``t``: a DTensor's local piece
    ([Note: parameters another parallelism split]), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def set_local(param: torch.Tensor, data: torch.Tensor) -> None:
    """Point ``param`` at ``data``: its data, or a DTensor's local piece (whose own dtype
    and shape stay: ``data`` is one of that dtype and local shape)."""
    if isinstance(param, DTensor):
        param._local_tensor = data
    else:
        param.data = data


def chunk_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def local_rows(rows: int, world: int, rank: int) -> int:
    c = chunk_rows(rows, world)
    return max(0, min(c, rows - rank * c))


@dataclass(eq=False)
class ParamSlot:
    """One parameter's place in its unit."""

    fqn: str
    param: nn.Parameter                      # the user's parameter: the unsharded one
    owners: list[tuple[nn.Module, str]]      # every (module, attr) registering it
    shape: torch.Size                        # what is sharded: the parameter's, or its local
    offset: int                              # in the unit's shard buffer
    chunk: int                               # padded rows per rank
    local: int                               # rows this rank holds
    rank: int
    spec: DTensorSpec | None = None          # a DTensor parameter's own (tensor parallel)
    dp: tuple | None = None                  # (mesh, placements) of its own group, or None
    aliases: list = field(default_factory=list)   # the user's, where ``param`` replaced it
    hooks: tuple | None = None               # a subclass's gather hooks (``hooks_of``)
    # (what the runtime makes for a slot, the rows the optimizer steps and ZeRO-3's
    # registered DTensor, is the runtime's own: runtime/param_table.py)
    _layouts: dict = field(default_factory=dict, repr=False)   # as_dtensor's, per mesh

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def inner(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return self.rows * self.inner

    @property
    def cols(self) -> slice:
        return slice(self.offset, self.offset + self.chunk * self.inner)

    @property
    def stride(self) -> tuple[int, ...]:
        """The full parameter's contiguous strides (what a Shard(0) DTensor declares)."""
        return torch.empty(self.global_shape, device="meta").stride()

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape as the model sees it (a DTensor's global one)."""
        return self.shape if self.spec is None else self.spec.shape

    @property
    def local_numel(self) -> int:
        return self.local * self.inner

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.local,) + tuple(self.shape[1:]))

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows as a view of a unit's flat shard buffer."""
        return flat[self.offset:self.offset + self.local_numel].view(self.local_shape)

    def piece_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole parameter-shaped ``whole`` as tensor parallelism
        places it (``spec``), a view; ``whole`` itself for a plain parameter."""
        if self.spec is None:
            return whole
        shape, offset = compute_local_shape_and_global_offset(
            self.spec.shape, self.spec.mesh, self.spec.placements)
        for dim, (n, start) in enumerate(zip(shape, offset)):
            whole = whole.narrow(dim, start, n)
        return whole

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor, as a view."""
        start = self.rank * self.chunk
        return full.narrow(0, min(start, self.rows), self.local)

    def as_dtensor(self, local: torch.Tensor, mesh, placements: tuple = (Shard(0),),
                   requires_grad: bool = False) -> DTensor:
        """``local`` (this rank's rows) as the ``Shard(0)`` DTensor of the full parameter
        (on HSDP's 2-D mesh, ``Replicate()`` along the replicate dim, as FSDP2's), on the
        data-parallel ``mesh`` concatenated with the parameter's own where it is a DTensor
        ([Note: parameters another parallelism split]); a slot with a group of its own
        declares its own mesh instead ([Note: a module's own group]).

        Built directly, as FSDP2 builds its CPU-offloaded parameters: ``DTensor.from_local``
        would copy a host ``local`` onto the mesh's device, and the DTensor would stop
        aliasing zerofn's buffers (an offload arena, an NVMe staging view).
        """
        mesh, placements = self.layout(mesh, placements)
        spec = DTensorSpec(mesh, placements,
                           TensorMeta(self.global_shape, self.stride, local.dtype))
        return DTensor(local, spec, requires_grad=requires_grad)

    def layout(self, mesh: DeviceMesh, placements: tuple) -> tuple[DeviceMesh, tuple]:
        """The mesh and placements of this parameter's sharded DTensors, given the
        data-parallel ``mesh`` and its ``placements`` (made once per mesh), or the slot's own
        ([Note: a module's own group])."""
        if self.dp is not None:
            mesh, placements = self.dp
        if self.spec is None:
            return mesh, placements
        key = (id(mesh), placements)
        if key not in self._layouts:
            split = self.spec.num_shards_map[0]
            dp = tuple(_StridedShard(0, split_factor=split) if isinstance(p, Shard) and split > 1
                       else p for p in placements)
            self._layouts[key] = (DeviceMesh._concatenate([mesh, self.spec.mesh]),
                                  dp + tuple(self.spec.placements))
        return self._layouts[key]


@dataclass(eq=False)
class Unit:
    """Parameters gathered together; ``module`` is where its hooks go.

    Three dtypes, each for one thing: ``dtype`` is the parameters' own, as the model was
    built (never rewritten); ``compute_dtype`` what forward, backward and the all-gathers
    run in; ``master_dtype`` what the optimizer steps and keeps its state in. The runtime
    sets the last two from the plan (``set_dtypes``) before anything is laid out.
    """

    name: str
    module: nn.Module
    slots: list[ParamSlot] = field(default_factory=list)
    shard_numel: int = 0
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    compute_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    replicated: bool = False     # ZeRO-3's small persistent params: whole on every rank
    group: str | None = None     # groups='s pattern naming its module, or None (group=)

    # (cached: every gather asks, and a built unit's slots do not change)
    @functools.cached_property
    def hooked(self) -> list[ParamSlot]:
        """The slots a subclass's hooks gather (runtime/subclass.py), last in the unit."""
        return [s for s in self.slots if s.hooks is not None]

    @functools.cached_property
    def plain_numel(self) -> int:
        """The elements of each rank's shard that the unit's own all-gather moves: every
        slot but those a subclass's hooks gather, which come last."""
        return self.hooked[0].offset if self.hooked else self.shard_numel

    @property
    def trainable(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.requires_grad]


def set_dtypes(units: list[Unit], compute: torch.dtype | None, mixed: bool) -> None:
    """Each unit's compute and master dtypes: ``compute`` (mixed precision's) or the
    parameters' own; masters in fp32 under mixed precision, whatever dtype the model was
    built in (DeepSpeed's bf16 mode does the same), else the parameters' own, as
    torch.optim keeps them. Non-floating parameters stay as they are."""
    for u in units:
        floating = u.dtype is not None and u.dtype.is_floating_point
        u.compute_dtype = compute if compute is not None and floating else u.dtype
        u.master_dtype = torch.float32 if mixed and floating else u.dtype


def scatter_to_ranks(full: torch.Tensor, cols: torch.Tensor) -> None:
    """Copy a full tensor into its columns of a rank-major ``(world, shard)`` view."""
    flat = full.reshape(-1)
    width = cols.shape[1]
    if not width:   # a parameter without elements (zero rows, or a zero inner dim)
        return
    whole, rem = divmod(flat.numel(), width)
    if whole:
        cols[:whole].copy_(flat[:whole * width].view(whole, width))
    if rem:
        cols[whole, :rem].copy_(flat[whole * width:])


def gather_from_ranks(cols: torch.Tensor, full: torch.Tensor) -> None:
    """The inverse of ``scatter_to_ranks``: fill a full tensor from its columns."""
    flat = full.view(-1)
    width = cols.shape[1]
    if not width:
        return
    whole, rem = divmod(flat.numel(), width)
    if whole:
        flat[:whole * width].view(whole, width).copy_(cols[:whole])
    if rem:
        flat[whole * width:].copy_(cols[whole, :rem])


def build_units(model: nn.Module, policy, world: int, rank: int,
                persist_below: int = 0, device: torch.device | None = None,
                own: dict | None = None) -> list[Unit]:
    """Group the model's parameters into units; the root unit comes last.

    A parameter belongs to the innermost unit whose module holds it; one held by two
    units (tied across them) belongs to the root. Parameters under ``persist_below``
    elements go to one replicated unit instead, placed before the root. Parameters on the
    meta device will be materialized on ``device``. ``own``: ``{module: its own group}``
    (runtime/mesh.py's ``OwnGroup``), units laid out over that group ([Note: a module's own
    group]).
    """
    own = own or {}
    # Once each: a module under two parents (two ModuleLists, or listed by two names) is
    # one unit, not two sets of hooks over the same parameters.
    unit_modules = list(dict.fromkeys(_unit_modules(model, policy) + list(own)))
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    units = {m: Unit(names[m] or "<root>", m, group=own[m].pattern if m in own else None)
             for m in unit_modules}
    units[model] = Unit("<root>", model)
    owner_unit: dict[nn.Parameter, Unit] = {}
    owners: dict[nn.Parameter, list] = {}
    fqns: dict[nn.Parameter, str] = {}
    module_at = dict(model.named_modules(remove_duplicate=False))
    for mod_name, module in module_at.items():
        unit = _innermost(model, module_at, mod_name, units)
        # Every registration, also a second name in the same module (``out = inp``).
        for pname, p in module._parameters.items():
            if p is None:
                continue
            if (module, pname) not in owners.setdefault(p, []):   # a shared module: once
                owners[p].append((module, pname))
            fqns.setdefault(p, f"{mod_name}.{pname}" if mod_name else pname)
            if owner_unit.setdefault(p, unit) is not unit:
                owner_unit[p] = units[model]
    persistent = Unit("<persistent>", model, replicated=True)
    # [Note: gathered by a subclass's hooks] (runtime/subclass.py): such parameters last in
    # their unit, never in the persistent one (which is never gathered).
    hooked = {p: type(local_of(p).data) is not torch.Tensor for p in owner_unit}
    for p, unit in sorted(owner_unit.items(), key=lambda pu: hooked[pu[0]]):
        group = own.get(unit.module) if unit.group is not None else None
        if group is not None:
            _add_slot(unit, p, fqns[p], owners[p], dist.get_world_size(group.shard),
                      dist.get_rank(group.shard), device if p.is_meta else p.device,
                      (group.mesh, group.placements))
            continue
        small = p.numel() < persist_below and not hooked[p]
        _add_slot(persistent if small else unit, p, fqns[p], owners[p],
                  world, rank, device if p.is_meta else p.device)
    # The root stays even when empty: its hooks bracket the whole forward.
    return [units[m] for m in unit_modules if units[m].slots] \
        + [persistent] * bool(persistent.slots) + [units[model]]


def hooks_of(p: nn.Parameter, fqn: str) -> tuple | None:
    """How a tensor-subclass parameter is gathered ([Note: gathered by a subclass's hooks],
    runtime/subclass.py):
    ``(its type, the name of the inner tensor holding its values, its flatten context)``,
    or None for a plain tensor.

    A subclass (float8 or NF4 weights, any ``__torch_dispatch__`` wrapper) holds its values
    in inner tensors that only it knows how to gather. One with FSDP2's hooks says how
    (``fsdp_pre_all_gather``/``fsdp_post_all_gather``); one without is refused: laying out
    its outer storage would shard bytes that are not its values."""
    local = local_of(p).data
    kind = type(local)
    if kind is torch.Tensor:
        return None
    pre, post = (hasattr(local, h) for h in ("fsdp_pre_all_gather", "fsdp_post_all_gather"))
    if not (pre or post):
        raise ValueError(
            f"zerofn cannot shard parameter {fqn!r}: its tensor is a {kind.__name__}, a "
            "tensor subclass without FSDP2's all-gather hooks (fsdp_pre_all_gather/"
            "fsdp_post_all_gather), so zerofn cannot tell which of its bytes are its values. "
            "Give the subclass both hooks, apply zerofn to the model in plain tensors "
            "(convert to float8 or NF4 for inference after training), or shard this model "
            "with FSDP2's fully_shard.")
    if pre != post:
        raise ValueError(
            f"zerofn cannot shard parameter {fqn!r}: its {kind.__name__} defines "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} but not "
            f"{'fsdp_post_all_gather' if pre else 'fsdp_pre_all_gather'}; define both "
            "(FSDP2 requires the same).")
    names, ctx = local.__tensor_flatten__()
    inner = getattr(local, names[0]) if len(names) == 1 else None
    # (torchao's float8 wrapper holds the Linear's own nn.Parameter as its inner tensor)
    if inner is None or type(inner) not in (torch.Tensor, nn.Parameter) \
            or inner.shape != local.shape \
            or inner.dtype != local.dtype:
        raise ValueError(
            f"zerofn cannot shard parameter {fqn!r}: its {kind.__name__} holds its values in "
            f"{len(names)} inner tensors ({', '.join(names)}); zerofn shards a subclass whose "
            "__tensor_flatten__ gives one plain inner tensor of its own shape and dtype (the "
            "full-precision weight, as float8 training's wrapper holds it). Shard this model "
            "with FSDP2's fully_shard, or keep such weights frozen outside zerofn.")
    return kind, names[0], ctx


def _add_slot(unit: Unit, p: nn.Parameter, fqn: str, owners, world: int, rank: int,
              device: torch.device, dp: tuple | None = None) -> None:
    spec = p._spec if isinstance(p, DTensor) else None
    hooks = hooks_of(p, fqn)
    if hooks is not None and spec is not None:
        raise ValueError(f"zerofn cannot shard parameter {fqn!r}: a tensor subclass inside a "
                         "DTensor (tensor parallelism over a subclass weight) is not sharded "
                         "yet; apply tensor parallelism to plain weights, or use FSDP2.")
    shape = local_of(p).shape
    if p.dim() == 0:
        raise ValueError(f"zerofn cannot shard the 0-dim parameter {fqn!r} along dim 0; "
                         "give it shape (1,) instead.")
    if unit.dtype is None:
        unit.dtype, unit.device = p.dtype, device
    elif (p.dtype, device) != (unit.dtype, unit.device):
        raise ValueError(
            f"Parameter {fqn!r} is {p.dtype} on {device} but unit {unit.name!r} holds "
            f"{unit.dtype} on {unit.device}, and a unit holds one dtype on one device: cast "
            "the model to one dtype and device first, or " + _way_out(unit, p))
    chunk = chunk_rows(shape[0], world)
    slot = ParamSlot(fqn, p, owners, shape, unit.shard_numel, chunk,
                     local_rows(shape[0], world, rank), rank, spec, dp, hooks=hooks)
    unit.slots.append(slot)
    unit.shard_numel += aligned(chunk * slot.inner)


def aligned(numel: int) -> int:
    """``numel`` rounded up to the slots' alignment in a unit's shard."""
    return -(-numel // SLOT_ALIGN) * SLOT_ALIGN


def _way_out(unit: Unit, p: nn.Parameter) -> str:
    """How else to keep ``p`` out of ``unit``. The persistent unit takes every small
    parameter of the model, whatever unit its module is: only its threshold decides."""
    if unit.replicated:
        return (f"lower persist_below to {p.numel()} or less (DeepSpeed's "
                f"stage3_param_persistence_threshold to {p.numel() - 1} or less), so that this "
                "parameter is sharded instead of kept whole with the others under it.")
    return "give the odd parameters' modules units of their own (units=[...])."


def _innermost(model: nn.Module, module_at: dict, mod_name: str, units: dict) -> Unit:
    parts = mod_name.split(".") if mod_name else []
    for i in range(len(parts), 0, -1):
        m = module_at.get(".".join(parts[:i]))
        if m in units:
            return units[m]
    return units[model]


def _runs(module: nn.Module) -> bool:
    """Whether the module has a forward of its own: containers (ModuleList, ModuleDict) never
    run, so a unit's hooks on them would never fire (ZeRO-3 would never gather it)."""
    return type(module).forward is not nn.Module.forward


def _unit_modules(model: nn.Module, policy) -> list[nn.Module]:
    if policy is None:
        return default_unit_modules(model)
    if isinstance(policy, int):
        return _size_based(model, policy)
    modules = dict(model.named_modules(remove_duplicate=False))   # every name of a shared one
    chosen = []
    for item in policy:
        name = item if isinstance(item, str) else None
        if name is not None:
            if name not in modules:
                raise ValueError(f"units: the model has no submodule named {name!r}.")
            item = modules[name]
        if not any(item is m for m in modules.values()):
            raise ValueError(f"units: {type(item).__name__} is not a submodule of the model.")
        if not _runs(item):
            what = repr(name) if name is not None else "a submodule"
            raise ValueError(
                f"units: {what} is a {type(item).__name__}, which has no forward and never "
                "runs, so its hooks would never fire (ZeRO-3 gathers a unit when its module "
                "runs); list the modules it holds instead.")
        if item is not model:
            chosen.append(item)
    return chosen


def default_unit_modules(module: nn.Module) -> list[nn.Module]:
    """The default units' modules (``units=None``): the children of the ModuleLists no
    chosen child holds, a transformer's blocks but not the lists inside a block. A
    mixture's experts, a list inside its layer, run only where some token chose them: as
    units of their own they would be gathered on some ranks only (a collective the others
    never join), and each in a collective too small to pay."""
    chosen = []
    for child in module.children():
        if isinstance(module, nn.ModuleList) and _runs(child):
            chosen.append(child)       # (not descended into)
        else:
            chosen += default_unit_modules(child)
    return chosen


def _size_based(model: nn.Module, min_numel: int) -> list[nn.Module]:
    """Post-order: a module becomes a unit once it holds min_numel not-yet-claimed elements."""
    claimed: set[nn.Parameter] = set()
    chosen = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model or not _runs(module):   # a container's params go to its parent
            return
        fresh = {p for p in module.parameters() if p not in claimed}
        if sum(p.numel() for p in fresh) >= min_numel:
            chosen.append(module)
            claimed.update(fresh)

    visit(model)
    return chosen
