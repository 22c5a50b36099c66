"""zerofn as a strategy of PyTorch Lightning: ``ZeroStrategy`` for the ``Trainer``,
``ZeroFabricStrategy`` for ``Fabric``, sharing their options (``options.py``), precision
(``precision.py``) and checkpoints (``checkpoints.py``).

Importing this module registers, with both of Lightning's strategy registries, names that
mirror Lightning's DeepSpeed ones, so a script changes one string::

    import zerofn.integrations.lightning   # registers the names
    trainer = L.Trainer(strategy="zerofn_stage_3", precision="bf16-mixed")

``zerofn_stage_1``, ``zerofn_stage_2``, ``zerofn_stage_2_offload``, ``zerofn_stage_3``,
``zerofn_stage_3_offload`` and ``zerofn_stage_3_offload_nvme``. Needs the ``lightning``
package (``pip install 'zerofn[lightning]'``); ``docs/lightning.md`` is the guide.
"""
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from .fabric import ZeroFabricStrategy
from .options import REGISTERED
from .precision import ZeroFabricPrecision, ZeroPrecision
from .trainer import ZeroStrategy

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "ZeroPrecision", "ZeroFabricPrecision",
           "STRATEGY_NAMES"]

#: The strategy names registered with Lightning's Trainer and Fabric on import.
STRATEGY_NAMES = tuple(REGISTERED)

ZeroStrategy.register_strategies(StrategyRegistry)
ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)
