"""Which home each unit's state lives in: "device", "host" or "nvme", from the offload
policy. Three ways to choose the map, one result:

- no offload: every unit on the device;
- ``ratio=r``: the units first in parameter order keep theirs on the device, up to 1 - r
  of the parameters ([Note: which units stay]); the rest go where ``offload`` names;
- ``placement={pattern: home}``: unit names or patterns (``"blocks.*"``, ``"blocks.[30-39]"``
  for a range of numbers, ``"<root>"``), the first pattern a unit matches deciding; the
  units no pattern names go where ``offload`` names;
- ``ratio="auto"``: set-up puts every unit on the host, the units beyond ``host_budget``
  (in parameter order) in the swap file; after the first step as many as the device
  budget holds move to the device (runtime/placement.py).

[Note: which units stay] The units whose first parameter comes first in the model's
parameter order stay on the device: in a transformer those are the embeddings and the
first blocks, whose gradients arrive last in backward (so the host has its share's
gradients earliest) and whose parameters the next forward needs first (so they are
refreshed on the device, with no copy up, before anything else). DeepSpeed's Twin-Flow
keeps the first sub-groups in parameter order the same way.
"""
from __future__ import annotations

import fnmatch
import re

from ...core.plan import HOMES
from ...core.units import Unit

HOMES = HOMES


def in_parameter_order(units, order: dict) -> list:
    """``units`` by their first parameter's place in the model (``order``: a parameter's
    name to its index in ``model.named_parameters()``; [Note: which units stay])."""
    return sorted(units, key=lambda u: min(order.get(s.fqn, 0) for s in u.slots))


def offloaded_home(policy) -> str:
    """Where ``offload`` sends what no choice keeps elsewhere."""
    return {"cpu": "host", "nvme": "nvme"}[policy.device]


def homes_of(units: list[Unit], policy, order: dict, costs=None) -> dict[Unit, str]:
    """Each unit's home under ``policy`` (``order``: parameter name -> index in the model;
    ``costs``: what units cost on the host, for ``host_budget``: offload's ``HostCosts``)."""
    if policy.device is None:
        return {u: "device" for u in units}
    rest = offloaded_home(policy)
    if policy.placement:
        return placement_homes(units, policy.placement, rest)
    if policy.ratio == "auto":
        return _budgeted(units, order, policy.host_budget, costs, rest)
    where = {u: rest for u in units}
    for u in staying_units(units, policy.ratio, order):
        where[u] = "device"
    return where


def staying_units(units: list[Unit], ratio: float, order: dict) -> list[Unit]:
    """The units first in parameter order while they total at most (1 - ratio) of the
    parameters ([Note: which units stay])."""
    sized = [u for u in units if u.slots]
    room = (1 - ratio) * sum(s.numel for u in sized for s in u.slots)
    staying = []
    for u in in_parameter_order(sized, order):
        n = sum(s.numel for s in u.slots)
        if n > room:
            break
        staying.append(u)
        room -= n
    return staying


def _budgeted(units, order: dict, budget, costs, rest: str) -> dict[Unit, str]:
    """ratio="auto" at set-up: the host holds the units first in parameter order while the
    host's whole share fits ``budget`` (every unit where there is no budget), the rest go to
    ``rest``. The share counts every offloaded unit's landing buffer and, while any unit is
    in the swap file, its staging ring; where even those exceed the budget, ValueError names
    the least budget that works."""
    where = {u: "host" for u in units}
    if budget is None or rest == "host":
        return where
    sized = in_parameter_order([u for u in units if u.slots], order)
    landing = sum(costs.landing(u) for u in sized)
    if landing + sum(costs.on_host(u) for u in sized) <= budget:
        return where        # everything fits: no swap file
    used, swapped = landing + costs.staging(sized), []
    if used > budget:
        raise ValueError(
            f"offload(host_budget={budget}): the landing buffers and the swap file's staging "
            f"ring alone take {used} bytes of host memory; give host_budget at least {used}.")
    for u in sized:
        if swapped or used + costs.on_host(u) > budget:
            swapped.append(u)
            where[u] = rest
        else:
            used += costs.on_host(u)
    return where


def placement_homes(units: list[Unit], placement: dict, rest: str) -> dict[Unit, str]:
    """``placement``'s map, checked by ``placement_problems``: the first pattern a unit's
    name matches decides; the others go to ``rest``."""
    where = {}
    for u in units:
        where[u] = next((home for pattern, home in placement.items()
                         if _matches(pattern, u.name)), rest)
    return where


def placement_problems(units: list[Unit], policy) -> list[str]:
    """What is wrong with ``placement=`` for these units (raised on every rank first)."""
    placement = policy.placement
    if not placement:
        return []
    if not isinstance(placement, dict):
        return [f"offload(placement=...) takes a dict of unit names or patterns to a home "
                f"({', '.join(HOMES)}); got {type(placement).__name__}."]
    problems = []
    names = [u.name for u in units if u.slots]
    for pattern, home in placement.items():
        if home not in HOMES:
            problems.append(f"offload(placement=...): {pattern!r} -> {home!r}: the home "
                            f"must be one of {', '.join(map(repr, HOMES))}.")
        elif not any(_matches(pattern, n) for n in names):
            problems.append(f"offload(placement=...): {pattern!r} names no unit; the units "
                            f"are {', '.join(map(repr, names))}.")
    if policy.ratio != 1.0:
        problems.append("offload(placement=...) chooses each unit's home itself: drop ratio=.")
    if "nvme" in placement.values() and not policy.path:
        problems.append("offload(placement=...) sends units to 'nvme': give path= (a "
                        "directory on the drive).")
    return problems


def _matches(pattern: str, name: str) -> bool:
    """fnmatch's globs, plus ``[a-b]`` for a number from a to b (``blocks.[30-39]``)."""
    ranges = []

    def number(m: re.Match) -> str:
        ranges.append((int(m.group(1)), int(m.group(2))))
        return "\0"
    marked = re.sub(r"\[(\d+)-(\d+)\]", number, pattern)
    regex = fnmatch.translate(marked).replace("\0", r"(\d+)")
    m = re.fullmatch(regex.removeprefix("(?s:").removesuffix(")\\Z"), name)
    return m is not None and all(lo <= int(g) <= hi for g, (lo, hi) in zip(m.groups(), ranges))
