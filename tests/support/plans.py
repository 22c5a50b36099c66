"""The plan a transform builds: what the runtime is made from."""
from __future__ import annotations

import functools

from zerofn.core.plan import Plan


def plan_of(transform) -> Plan:
    return functools.reduce(lambda plan, edit: edit(plan), transform._edits, Plan())
