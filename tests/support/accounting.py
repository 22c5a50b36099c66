"""What the layout may add to the model-state bytes of docs/design.md's formulas."""
from __future__ import annotations

from zerofn.core.units import SLOT_ALIGN


def padding_bound(model, world: int) -> int:
    """Elements the layout may add across ranks: torch.chunk's padding (under ``world - 1``
    rows per param) and each rank's slot alignment (under ``SLOT_ALIGN`` elements)."""
    return sum((world - 1) * (p.numel() // p.shape[0]) + world * (SLOT_ALIGN - 1)
               for p in model.parameters())
