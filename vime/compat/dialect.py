"""slime's and vllm-project/vime's surface as a `vime.dialect.Dialect`: what the entry points hand the
core (`SLIME`), so that run scripts and plug-ins written for them run on vime as they are.

* Flags: Megatron's and slime's that vime keeps no setting for (`FLAGS`: checked against the
  checkpoint, mapped, or named at start-up), with what each is in slime for those it refuses.
* Plug-in paths: slime's spellings of vime's functions become vime's (`translate`), so a run's
  checks see the function the path names.
* Plug-in imports: `slime.*` and vllm-project/vime's module paths (`imports.py`), installed in every
  process the config reaches (a pickled `SLIME` installs them where it is loaded).
* Services: the router vllm-project/vime's custom generate functions post to (`router.py`), and the names
  they read on `args` (`vllm_router_ip`, `vllm_router_port`, `context_parallel_size`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from vime.compat import imports, model, parse, startup
from vime.compat.answer_log import AnswerLog
from vime.compat.flags import FLAGS
from vime.compat.router import Router
from vime.dialect import PluginServices
from vime.modes import DEFAULT_ROLLOUT_FN, custom_rollout
from vime.plugins import IMPORT_EXPLAINERS, OPD_POST_PROCESS, OPD_REWARD

# slime's (and vllm-project/vime's) spellings of vime's functions, by the flags that name functions
PATHS = {
    "vime.rollout.vllm_rollout.generate_rollout": DEFAULT_ROLLOUT_FN,
    "slime.rollout.vllm_rollout.generate_rollout": DEFAULT_ROLLOUT_FN,
    "slime.rollout.on_policy_distillation.reward_func": OPD_REWARD,
    "slime.rollout.on_policy_distillation.post_process_rewards": OPD_POST_PROCESS,
}
PATH_FLAGS = (
    "rollout_function_path",
    "custom_generate_function_path",
    "custom_rm_path",
    "custom_reward_post_process_path",
    "dynamic_sampling_filter_path",
    "custom_loss_function_path",
    "custom_tis_function_path",
    "custom_advantage_function_path",
)


class SlimeServices:
    """The router of a run whose custom generate or rollout function may reach the engines
    itself, and what its answers' log-probs are kept in for the samples a plug-in rebuilds."""

    def __init__(self, cfg: Any, runtime: Any) -> None:
        ro = cfg.rollout
        answers = AnswerLog() if ro.custom_generate_function_path else None  # only a custom generate gives them back
        self.router = Router(runtime, ro.rollout_max_response_len, answers=answers).start()
        self.live = {"vllm_router_ip": self.router.host, "vllm_router_port": self.router.port}

    def restore(self, samples: list[Any]) -> None:
        if self.router.answers is not None:
            for s in samples:
                self.router.answers.restore(s)

    def stop(self) -> None:
        self.router.stop()


class Slime:
    name = "slime"
    # what every plug-in's `args` has besides the settings: the router's address (None where the
    # run has none) and Megatron's context-parallel size (one: vime never splits a sequence;
    # retool sizes its context as context_parallel_size × max_tokens_per_gpu)
    plugin_names = {"vllm_router_ip": None, "vllm_router_port": None, "context_parallel_size": 1}  # noqa: RUF012

    @property
    def flags(self) -> Collection[str]:
        return FLAGS

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parse.add_arguments(parser)

    def unknown_flags_error(self, unknown: list[str], known: list[str]) -> str | None:
        return parse.unknown_flags_error(unknown, known)

    def translate(self, values: dict[str, Any]) -> None:
        parse.translate(values)
        for name in PATH_FLAGS:
            path = values.get(name)
            if isinstance(path, str):
                values[name] = PATHS.get(path.replace(":", "."), path)

    def checks(self, cfg: Any) -> list[tuple[bool, str]]:
        return startup.checks(cfg)

    def notes(self, cfg: Any) -> tuple[list[str], list[str]]:
        return startup.notes(cfg)

    def check_model(
        self, cfg: Any, model_dir: Path, read_config: Callable[[Path], dict], gpu_bytes: int | None
    ) -> list[str]:
        return model.check_model(cfg, model_dir, read_config, gpu_bytes)

    def install(self) -> None:
        imports.install()
        if _explain not in IMPORT_EXPLAINERS:
            IMPORT_EXPLAINERS.append(_explain)

    def explain_import_error(self, e: ImportError) -> str | None:
        return _explain(e)

    def plugin_services(self, cfg: Any, runtime: Any) -> PluginServices | None:
        return SlimeServices(cfg, runtime) if custom_rollout(cfg.rollout) and runtime.engines else None

    def close_run(self) -> None:
        import sys

        if "vime.compat.utils.http_utils" in sys.modules:  # a plug-in called vllm-project/vime's post()/get()
            from vime.compat.utils.http_utils import close_sessions
            from vime.rollout import async_loop

            async_loop.run(close_sessions())

    def __reduce__(self) -> tuple[Any, ...]:
        """Unpickled (a trainer rank, the rollout process), it is `SLIME`, installed there."""
        return _loaded, ()


def _explain(e: BaseException) -> str | None:
    """What a failed import of a plug-in's slime or vllm-project/vime name means: a name of a real
    slime that stands in for vime's, or one of vllm-project/vime's that vime lacks."""
    if not isinstance(e, ImportError) or not e.name:
        return None
    top = e.name.split(".")[0]
    text = str(e)
    if isinstance(e, ModuleNotFoundError):
        lacked = e.name
    elif text.startswith("cannot import name"):
        lacked = f"{text.split(chr(39))[1]} from {e.name}"
    else:  # the module itself failed as it was imported: plugins.py names that
        return None
    if top == imports.ALIAS and (slime := imports.installed_slime()) is not None:
        return (
            f"imports {lacked}, which the installed slime package ({slime}) does not have: install the slime the "
            "plug-in was written for, or uninstall slime so vime answers slime.* imports (docs/plugin-compat.md)"
        )
    if top in (imports.ALIAS, "vime"):
        return (
            f"imports {lacked}, which vime does not have (a name of vllm-project/vime's?): docs/plugin-compat.md "
            "lists the vllm-project/vime names vime has"
        )
    return None


SLIME = Slime()


def _loaded() -> Slime:
    SLIME.install()
    return SLIME
