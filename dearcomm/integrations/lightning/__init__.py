"""dearcomm as a Lightning strategy (pip install 'dearcomm[lightning]').

    from dearcomm.integrations.lightning import DearStrategy
    trainer = lightning.Trainer(strategy=DearStrategy(), accelerator="cpu", devices=2)

Importing this module also registers the name "dear": ``Trainer(strategy="dear")``.
"""
from .._requires import require

require("lightning.pytorch", "lightning")

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from .strategy import DearStrategy  # noqa: E402

DearStrategy.register_strategies(StrategyRegistry)

__all__ = ["DearStrategy"]
