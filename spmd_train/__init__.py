"""spmd_train: train large transformers on any device mesh with JAX.

Public API: `load_config` (YAML + overrides -> Config), `Trainer` (init/resume, step, run,
save, restore, describe), `train` (a whole run in one call), `Engine` (mesh, shardings,
train step), `build_mesh`, `Layout` and `constrain` (logical sharding), `simulate_devices`.
"""

from spmd_train.launch_guard import guard_cli_imports

guard_cli_imports()  # first: the imports below take seconds, and Ctrl-C during them is the command's to report

from spmd_train.config import Config, load_config  # noqa: E402
from spmd_train.devices import simulate_devices  # noqa: E402
from spmd_train.errors import ConfigError  # noqa: E402
from spmd_train.mesh import build_mesh  # noqa: E402
from spmd_train.sharding import Layout, constrain, use_layout  # noqa: E402
from spmd_train.tpu_flags import apply_tpu_flags  # noqa: E402
from spmd_train.train.engine import Engine, TrainState  # noqa: E402
from spmd_train.train.loop import TrainResult, train  # noqa: E402
from spmd_train.train.trainer import Trainer  # noqa: E402

apply_tpu_flags()  # importing jax loads no backend; libtpu reads LIBTPU_INIT_ARGS once, when it loads

__all__ = [
    "Config",
    "ConfigError",
    "Engine",
    "Layout",
    "TrainResult",
    "TrainState",
    "Trainer",
    "build_mesh",
    "constrain",
    "load_config",
    "simulate_devices",
    "train",
    "use_layout",
]
