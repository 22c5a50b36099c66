"""Which ranks shard together and which replicate: the ``group=`` option read as a layout.

A ProcessGroup or 1-D DeviceMesh shards over its ranks. A 2-D DeviceMesh is hybrid
sharding (HSDP, as FSDP2's ``fully_shard(mesh=mesh_2d)``): parameters, gradients and
optimizer state are sharded along the shard dimension exactly as over a 1-D group, and
every shard is replicated along the replicate dimension, whose ranks average their
reduced gradient shards. [Note: naming the dims] A mesh whose dims are named
"replicate" and "shard" (in either order) is read by name; a mesh naming neither is
read like FSDP2 reads one: dim 0 replicates, dim 1 shards. Naming only one of the two
is refused, as is any other number of dims, before any collective.
"""
from __future__ import annotations

import datetime
import fnmatch
import math
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

REPLICATE, SHARD = "replicate", "shard"


@dataclass
class Groups:
    """The groups a runtime talks over.

    ``shard``: the ranks one parameter is split over (all of them without HSDP);
    ``replicate``: the ranks holding the same shard as this one (HSDP), else None;
    ``everyone``: every rank of the layout (set-up agreement, checkpoints);
    ``mesh`` and ``placements``: how a sharded parameter is declared as a DTensor;
    ``model``: where tensor parallelism split parameters, the mesh they are DTensors on
    (``model_parallel``), else None: the ranks holding other pieces of the same rows.
    """

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    everyone: dist.ProcessGroup
    mesh: DeviceMesh
    placements: tuple
    model: DeviceMesh | None = None
    explicit: bool = True     # group= was a DeviceMesh (not None or a ProcessGroup)


def mesh_dims(mesh: DeviceMesh) -> tuple[int | None, int]:
    """``(replicate dim or None, shard dim)`` of a 1-D or 2-D mesh; ValueError for a mesh
    zerofn cannot use (see [Note: naming the dims]). Local: no collective."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        if names == (REPLICATE,):
            raise ValueError("zerofn got a 1-D DeviceMesh named 'replicate', which shards "
                             "nothing: pass a 2-D mesh with dims ('replicate', 'shard') for "
                             "hybrid sharding, or a 1-D mesh to shard over.")
        return None, 0
    if mesh.ndim != 2:
        raise ValueError(
            f"zerofn shards over a 1-D DeviceMesh, or hybrid-shards over a 2-D one with "
            f"dims ('replicate', 'shard'); got a {mesh.ndim}-D mesh with dims {names or None}. "
            "Pass the data-parallel sub-mesh, e.g. mesh['replicate', 'shard'] or mesh['dp'].")
    known = [n for n in names if n in (REPLICATE, SHARD)]
    if known and sorted(known) != [REPLICATE, SHARD]:
        raise ValueError(
            f"zerofn reads a 2-D DeviceMesh's dims by their names 'replicate' and 'shard', "
            f"or, where neither is used, as (replicate, shard) in that order; got dims "
            f"{names}. Name both dims (mesh_dim_names=('replicate', 'shard')) or neither.")
    if known:
        return names.index(REPLICATE), names.index(SHARD)
    return 0, 1


def groups_of(group, device_type: str) -> Groups:
    """The layout ``group=`` asks for: None (the world), a ProcessGroup, or a DeviceMesh."""
    if not isinstance(group, DeviceMesh):
        group = group or dist.group.WORLD
        return Groups(group, None, group, DeviceMesh.from_group(group, device_type), (Shard(0),),
                      explicit=False)
    mesh = group
    replicate, shard = mesh_dims(mesh)
    if mesh.get_coordinate() is None:
        raise ValueError(f"This rank ({dist.get_rank()}) is not in the DeviceMesh passed as "
                         "group=; apply zerofn only on the mesh's ranks.")
    if replicate is None:
        return Groups(mesh.get_group(), None, mesh.get_group(), mesh, (Shard(0),))
    placements = tuple(Shard(0) if d == shard else Replicate() for d in range(2))
    everyone = dist.group.WORLD if mesh.size() == dist.get_world_size() \
        else mesh._flatten().get_group()
    return Groups(mesh.get_group(shard), mesh.get_group(replicate), everyone, mesh, placements)


def with_timeout(groups: Groups, timeout: float | None, own: dict) -> Groups:
    """The sharding option ``timeout=``: the seconds any collective of zerofn's may wait
    before failing. The user's groups keep their own timeouts: zerofn makes a group of its
    own over the world with this one (a collective of every rank, as they all apply the
    transform; on NCCL one more communicator) and talks over it. A group or mesh of the
    user's (``group=``, ``groups=``) was made with the timeout its maker chose, so
    ``timeout=`` beside one is refused (local: every rank raises alike). None: ``groups``
    as they are."""
    if timeout is None:
        return groups
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: give the seconds a collective may wait for "
                         "the slowest rank (> 0), or None for the group's own timeout.")
    if groups.explicit or own or groups.shard is not dist.group.WORLD:
        raise ValueError(
            f"timeout={timeout:g} gives a group zerofn makes over every rank its timeout, "
            "and this model is sharded over a group or mesh of yours (group= or groups=), "
            "whose timeout zerofn leaves as you made it: create those groups with the "
            "timeout (dist.new_group(ranks, timeout=...), or init_process_group(timeout=...) "
            "before init_device_mesh) and drop timeout=.")
    made = dist.new_group(dist.get_process_group_ranks(groups.shard),
                          timeout=datetime.timedelta(seconds=timeout),
                          backend=dist.get_backend(groups.shard))
    return Groups(made, None, made, DeviceMesh.from_group(made, groups.mesh.device_type),
                  groups.placements, explicit=False)


def model_parallel(groups: Groups, specs: list) -> list[str]:
    """Where parameters are DTensors already (tensor parallelism: ``specs``, their own
    DTensor specs), the data-parallel layout joins their mesh as FSDP2's does
    (core/units.py's [Note: parameters another parallelism split]): ``groups.model`` is
    that mesh and ``everyone`` all ranks of both. Returns what zerofn cannot shard, as
    problems (raised on every rank by the caller); local, no collective."""
    if not specs:
        return []
    meshes = {s.mesh for s in specs}
    if len(meshes) > 1:
        return [f"the model's DTensor parameters lie on {len(meshes)} different meshes; "
                "zerofn shards parameters split over one tensor-parallel mesh."]
    mesh = meshes.pop()
    odd = next((p for s in specs for p in s.placements
                if type(p) is not Shard and not isinstance(p, Replicate)), None)
    if odd is not None:
        return [f"a parameter is a DTensor with placement {odd}, which zerofn cannot shard "
                "over (it shards parameters placed Shard(d) or Replicate() by tensor "
                "parallelism); apply zerofn to the model as parallelize_module left it."]
    if mesh.ndim > 2:
        return [f"a parameter lies on a {mesh.ndim}-D mesh; zerofn shards parameters of 1-D "
                "or 2-D (expert and tensor) parallelism, as FSDP2 does."]
    try:
        joined = DeviceMesh._concatenate([groups.mesh, mesh])
    except Exception as e:   # (another root: torch says why)
        return [f"the data-parallel mesh given as group= and the tensor-parallel mesh the "
                f"parameters lie on are not slices of one mesh ({type(e).__name__}: {e}); "
                "take both from the same init_device_mesh, e.g. mesh['dp'] and mesh['tp']."]
    groups.model = mesh
    groups.everyone = dist.group.WORLD if joined.size() == dist.get_world_size() \
        else joined._flatten().get_group()
    return []


@dataclass
class OwnGroup:
    """A module's own data-parallel group (``groups=``): the experts that expert
    parallelism gave this rank shard over ``mesh`` (the ranks holding the same experts)
    while the rest of the model shards over the whole data-parallel group.

    ``pattern``: the key of ``groups=`` that named the module; ``dp_world``: the size of
    the whole data-parallel layout, which the experts' summed gradients are divided by
    ([Note: experts' gradients] in context.py)."""

    pattern: str
    shard: dist.ProcessGroup
    mesh: DeviceMesh
    placements: tuple
    dp_world: int


def own_groups(option, model, groups: Groups, init=None) -> dict:
    """``{module: OwnGroup}`` for ``groups=``, or ValueError naming what is wrong (``init``:
    the option a meta-built model is initialized with). Local: every rank raises alike,
    before any collective."""
    if option is None:
        return {}
    if not isinstance(option, dict) or not all(
            isinstance(k, str) and isinstance(v, DeviceMesh) and v.ndim == 1
            for k, v in option.items()):
        raise ValueError(
            f"groups= takes a dict of module names or patterns to 1-D DeviceMeshes, e.g. "
            f"{{'blocks.*.moe.experts': mesh['edp']}}; got {_shown(option)}.")
    if groups.replicate is not None:
        raise ValueError(
            "groups= gives modules a data-parallel mesh of their own, which zerofn does not "
            "combine with hybrid sharding (a 2-D group=): pass a 1-D group= (the whole "
            "data-parallel mesh) with groups=, or drop groups=.")
    split = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if split is not None:   # (the norm and vote over a tp mesh would count experts twice)
        raise ValueError(
            f"groups= takes a model whose parameters are plain tensors, and {split!r} is a "
            "DTensor (tensor parallelism, or experts split on an expert-parallel mesh): "
            "zerofn does not combine groups= with those yet. Hold each rank's experts as "
            "plain modules (expert parallelism by hand), or drop groups=.")
    if init is None and any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "groups= with a model built on the meta device: each module's reset_parameters() "
            "would draw every expert-parallel rank's experts from the same random stream, so "
            "the experts of one rank would start equal to another's. Build the model on a "
            "real device (each rank its experts), or pass init= a function that draws each "
            "expert's weights from a seed of its own (e.g. its global index).")
    modules = dict(model.named_modules())
    chosen = {}
    for pattern, mesh in option.items():
        matched = [m for n, m in modules.items()
                   if n and (n == pattern or fnmatch.fnmatchcase(n, pattern))]
        if not matched:
            raise ValueError(f"groups=: {pattern!r} matches no module of the model; give "
                             "module names as model.named_modules() spells them, or "
                             "fnmatch patterns such as 'blocks.*.moe.experts'.")
        experts_join(pattern, mesh, groups)
        for m in matched:
            if type(m).forward is nn.Module.forward:
                raise ValueError(
                    f"groups=: {pattern!r} names a {type(m).__name__}, which has no forward "
                    "and never runs, so its parameters could not be gathered when it does: "
                    "name the module that runs the experts (the one whose forward calls "
                    "them), or each expert ('...experts.*').")
            if m in chosen and chosen[m].pattern != pattern:
                raise ValueError(f"groups=: {chosen[m].pattern!r} and {pattern!r} both name "
                                 "one module; give each module one mesh.")
            chosen[m] = OwnGroup(pattern, mesh.get_group(), mesh, (Shard(0),),
                                 dist.get_world_size(groups.shard))
    return chosen


def experts_join(pattern: str, mesh: DeviceMesh, groups: Groups) -> None:
    """A module's mesh must be a slice of the data-parallel one: from the same root mesh
    where ``group=`` is a DeviceMesh, and always among its ranks (the experts' gradients
    are averaged over the whole data-parallel group). ValueError otherwise; local."""
    if mesh.get_coordinate() is None:
        raise ValueError(f"groups=: this rank ({dist.get_rank()}) is not in the mesh given "
                         f"for {pattern!r}; give each rank the slice of the mesh it is in "
                         "(mesh['edp'] on every rank).")
    dp = set(dist.get_process_group_ranks(groups.shard))
    ours = set(mesh.mesh.flatten().tolist())
    from_root = groups.mesh._get_root_mesh() is mesh._get_root_mesh()
    if not ours <= dp or (groups.explicit and not from_root):
        raise ValueError(
            f"groups=: the mesh for {pattern!r} (ranks {sorted(ours)}) is not a slice of the "
            f"data-parallel mesh given as group= (ranks {sorted(dp)}): take both from the "
            "same init_device_mesh, e.g. group=mesh['dp'] (a flattened ('edp', 'ep')) and "
            "groups={...: mesh['edp']}.")


def _shown(option) -> str:
    if not isinstance(option, dict):
        return type(option).__name__
    return "{" + ", ".join(f"{k!r}: {type(v).__name__}"
                           + (f" ({v.ndim}-D)" if isinstance(v, DeviceMesh) else "")
                           for k, v in option.items()) + "}"


def model_parallel_norms(ctx) -> tuple:
    """Where tensor parallelism split parameters (mesh.py's ``Groups.model``): the group
    over which the step's vote is taken again (every piece of the same rows takes the same
    step), and each slot's weight in the norm's sum, 1 over the number of its
    model-parallel ranks holding the same rows (a plain parameter: all of them), so the
    sum over that group counts each row once. None and {} without."""
    mesh = ctx.groups.model
    if mesh is None:
        return None, {}
    group = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    weight = {}
    for unit in ctx.units:
        for s in unit.trainable:
            copies = mesh.size() if s.spec is None else math.prod(
                n for n, p in zip(mesh.shape, s.spec.placements) if p.is_replicate())
            if copies > 1:
                weight[s] = 1.0 / copies
    return group, weight
