"""Offload as the tests ask for it: options as data (so a table of configs can hold them),
the parity model under a stage with offload and precision, and where a sharded state
dict's tensors lie."""
from __future__ import annotations

import zerofn as zf
from zerofn.runtime.runtime import runtime_of

from .loops import build_parity


def offload_transform(opts: dict):
    """zf.offload from ``opts``: "nvme": True for NVMe (at "path"), else the host; "path"
    is dropped for the host, so one dict can serve both."""
    opts = dict(opts)
    if opts.pop("nvme", False):
        return zf.offload("nvme", path=opts.pop("path"), **opts)
    opts.pop("path", None)
    return zf.offload("cpu", **opts)


def build_offloaded(stage: int, kind: str = "adamw", offload: dict | None = None,
                    precision=None, checkpoint: bool = False):
    """The parity model under ZeRO-``stage`` with ``offload`` (offload_transform's options;
    None: none) and ``precision`` (mixed_precision's compute dtype; None: fp32)."""
    extra = ([offload_transform(offload)] if offload is not None else []) + \
        ([zf.mixed_precision(precision)] if precision else [])
    return build_parity(stage, kind, *extra, checkpoint=checkpoint)


def sharded_state_locals(model, opt) -> dict[str, tuple[str, bool]]:
    """Each sharded state-dict tensor's local shard: its device type, and whether it is a
    view of the offload's host arenas (no copy made)."""
    from torch.distributed.tensor import DTensor
    spans = [(a.buffer.data_ptr(), a.buffer.data_ptr() + a.buffer.nbytes)
             for a in runtime_of(model).homes.arenas()]
    msd, osd = zf.get_state_dict(model, opt)
    entries = {f"model.{k}": v for k, v in msd.items()}
    entries.update({f"optim.{name}.{k}": v for name, st in osd["state"].items()
                    for k, v in st.items()})
    out = {}
    for key, value in entries.items():
        if isinstance(value, DTensor) and value.to_local().numel():
            local = value.to_local()
            out[key] = (local.device.type,
                        any(lo <= local.data_ptr() < hi for lo, hi in spans))
    return out
