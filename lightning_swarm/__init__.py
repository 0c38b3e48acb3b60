"""lightning_swarm: SWARM parallelism for PyTorch Lightning.

``import lightning_swarm`` registers the strategy name ``"swarm"``, so ``Trainer(strategy="swarm")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_swarm.client.routing import RouterStats
from lightning_swarm.errors import NotServingError, StageBusyError, StageUnavailableError, SwarmRequestError
from lightning_swarm.logs import quiet_hivemind_noise, use_swarm_log_handler
from lightning_swarm.settings import SwarmSettings
from lightning_swarm.strategy import SwarmStrategy

__version__ = "0.1.0"
__all__ = [
    "RouterStats",
    "SwarmSettings",
    "SwarmStrategy",
    "NotServingError",
    "StageBusyError",
    "StageUnavailableError",
    "SwarmRequestError",
]

use_swarm_log_handler()
quiet_hivemind_noise()
if SwarmStrategy.strategy_name not in StrategyRegistry:
    SwarmStrategy.register_strategies(StrategyRegistry)
