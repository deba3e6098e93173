"""slime's `--custom-config-path`: a YAML file whose keys override the run's settings.

slime reads it in its argument validation and sets every key on `args`, over whatever the command
line said (its examples: train_infer_mismatch_helper/mis.yaml sets the TIS flags, and keys of its
own that the example's TIS function reads from `args`). vime applies it the same way, first in
`Config.validate`, so each key that is a vime setting is read as its flag is (`load_yaml`) and
then checked by every check a flag gets; a slime/Megatron flag of vime/compat/ goes where the
command line's would. A key that is no vime setting becomes an attribute of args for plug-ins,
as in slime, and is recorded in `Config.custom_config` (config.yaml) and named at start-up.
"""

from __future__ import annotations

from typing import Any

from vime.config.values import load_yaml
from vime.dialect import dialect_of
from vime.errors import ConfigError


def apply_custom_config(cfg: Any) -> None:
    """Set the file's keys on `cfg` (a Config being validated); a one-line ConfigError on a key
    or value that cannot be taken. A `null` leaves a setting that cannot be None as it is (slime's
    mis.yaml writes `rs_lower_bound: null` for "not set": `load_yaml` drops it)."""
    where = f"--custom-config-path {cfg.custom_config_path}"
    extras: dict[str, Any] = {}
    dialect = dialect_of(cfg)
    values = load_yaml(cfg.custom_config_path, extras, what="--custom-config-path", foreign=dialect.flags)
    if "custom_config_path" in values:
        raise ConfigError(f"{where} names another custom config: give its keys in this file")
    values.setdefault("slime_flags", {})
    dialect.translate(values)  # slime's recompute flags -> activation checkpointing, as from the command line
    cfg.slime_flags = {**cfg.slime_flags, **values.pop("slime_flags")}
    cfg.vllm_args = {**cfg.vllm_args, **values.pop("vllm_args", {})}
    for name, value in values.items():
        setattr(cfg, name, value)
    for key, value in extras.items():
        attr = str(key).replace("-", "_")
        if not attr.isidentifier() or hasattr(type(cfg), attr):
            raise ConfigError(f"{where}: '{key}' cannot be an attribute of args (it names a part of vime's Config)")
        setattr(cfg, attr, value)
    cfg.custom_config = {str(k).replace("-", "_"): v for k, v in extras.items()}
