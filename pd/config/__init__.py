"""An engine's settings: frozen groups, each checked once (settings.py; the transfer group
is pd/kv_transfer/connector_config.py), the EngineConfig that holds them and resolves what
they leave to the machine (engine.py), and the flags that fill it (flags.py)."""

from pd.config.engine import ROLES, EngineConfig, SchedulerConfig, TierSettings
from pd.config.flags import add_engine_flags, config_from_args
from pd.config.settings import SchedulerSettings
from pd.kv_transfer.connector_config import TransferSettings

__all__ = ["ROLES", "EngineConfig", "SchedulerConfig", "SchedulerSettings", "TierSettings", "TransferSettings",
           "add_engine_flags", "config_from_args"]
