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
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

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
        return Groups(group, None, group, DeviceMesh.from_group(group, device_type), (Shard(0),))
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


def set_timeout(groups: Groups, timeout: float | None) -> None:
    """The sharding option ``timeout=``: the seconds any collective of the runtime's groups
    may wait before failing (None keeps each group's own, ``init_process_group``'s)."""
    if timeout is None:
        return
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: give the seconds a collective may wait for "
                         "the slowest rank (> 0), or None for the group's own timeout.")
    for group in {groups.everyone, groups.shard, groups.replicate} - {None}:
        c10d._set_pg_timeout(datetime.timedelta(seconds=timeout), group)


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
