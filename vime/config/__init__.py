"""One typed config for every entry point.

Flags keep slime's names (`--rollout-batch-size` ↔ `cfg.rollout_batch_size`), so a slime user's
scripts read naturally. The parser is generated from the dataclass fields: a field, its type,
default and help are written once. `--config run.yaml` is applied first; flags given on the
command line win over it.

The package, from the bottom up: fields.py (how a setting is declared), the *_fields.py
sections, schema.py (`Settings`: them all, and the values derived from them), values.py
(reading a value or a YAML file), custom_file.py and eval_sets.py (--custom-config-path and the
held-out sets, read at validation), checks_*.py and corrections.py (validation), core.py
(`Config`), parse.py (the command line). rooms.py holds each room's own settings, frozen and
built on access from the flat fields: `cfg.rollout`, `cfg.algorithm`, `cfg.trainer`,
`cfg.placement`, `cfg.eval`, `cfg.output`.
"""

from vime.config.algorithm_fields import ASYNC_CORRECTION, CORRECTIONS
from vime.config.core import ENTRIES, Config
from vime.config.fields import DERIVED, PASSTHROUGH, RUNTIME
from vime.config.parse import build_parser, parse_args
from vime.config.rooms import AlgorithmConfig, EvalConfig, OutputConfig, PlacementConfig, RolloutConfig, TrainerConfig
from vime.config.schema import FLAGS
from vime.config.values import load_yaml
from vime.errors import ConfigError
from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN

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
