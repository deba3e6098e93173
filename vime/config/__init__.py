"""One typed config for every entry point.

Flags keep slime's names (`--rollout-batch-size` ↔ `cfg.rollout_batch_size`), so a slime user's
scripts read naturally. The parser is generated from the dataclass fields: a field, its type,
default and help are written once. `--config run.yaml` is applied first; flags given on the
command line win over it.

Each setting is declared once, as a field of its component's settings (vime/setting.py): the
rollout's in vime/rollout/settings.py, the algorithm's in vime/algorithms/settings.py, the
placement's in vime/backends/settings.py, the trainer's, evaluation's and outputs' in
components.py. The package, from the bottom up: schema.py (`Settings`: them all, flat, and each
component's frozen view: `cfg.rollout`, `cfg.algorithm`, `cfg.trainer`, `cfg.placement`,
`cfg.eval`, `cfg.output`), values.py (reading a value or a YAML file), custom_file.py and
eval_sets.py (--custom-config-path and the held-out sets, read at validation), checks_*.py and
corrections.py (validation), core.py (`Config`), parse.py (the command line).
"""

from vime.algorithms.settings import ASYNC_CORRECTION, CORRECTIONS, AlgorithmConfig
from vime.backends.settings import PlacementConfig
from vime.config.components import EvalConfig, OutputConfig, TrainerConfig
from vime.config.core import ENTRIES, Config
from vime.config.parse import build_parser, parse_args
from vime.config.schema import FLAGS
from vime.config.values import load_yaml
from vime.errors import ConfigError
from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN
from vime.rollout.settings import RolloutConfig
from vime.setting import DERIVED, PASSTHROUGH, RUNTIME

__all__ = [
    "ASYNC_CORRECTION",
    "AlgorithmConfig",
    "EvalConfig",
    "OutputConfig",
    "PlacementConfig",
    "RolloutConfig",
    "TrainerConfig",
    "CORRECTIONS",
    "DEFAULT_ROLLOUT_FN",
    "DERIVED",
    "ENTRIES",
    "FLAGS",
    "FULLY_ASYNC_FN",
    "PASSTHROUGH",
    "RUNTIME",
    "Config",
    "ConfigError",
    "build_parser",
    "load_yaml",
    "parse_args",
]
