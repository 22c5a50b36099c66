"""zerofn as a strategy of PyTorch Lightning: ``ZeroStrategy`` for the ``Trainer``,
``ZeroFabricStrategy`` for ``Fabric``, sharing their options (``options.py``), precision
(``precision.py``), checkpoints (``checkpoints.py``) and the steps they take alike
(``strategy.py``).

``register_strategies()`` registers, with both of Lightning's strategy registries, names
that mirror Lightning's DeepSpeed ones, so a script changes one string::

    from zerofn.integrations.lightning import register_strategies
    register_strategies()                  # the zerofn_stage_* names
    trainer = L.Trainer(strategy="zerofn_stage_3", precision="bf16-mixed")

Importing the module registers nothing (Lightning 2.6 reads no entry point for strategies,
only for callbacks, so a call is how a strategy outside Lightning adds its names); a
strategy object, ``L.Trainer(strategy=ZeroStrategy(stage=3))``, needs no name at all.

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
           "STRATEGY_NAMES", "register_strategies"]

#: The strategy names ``register_strategies`` adds to Lightning's Trainer and Fabric.
STRATEGY_NAMES = tuple(REGISTERED)


def register_strategies() -> None:
    """Add the ``zerofn_stage_*`` names to Lightning's Trainer and Fabric registries (again
    is harmless: a name registered twice keeps zerofn's options)."""
    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)
