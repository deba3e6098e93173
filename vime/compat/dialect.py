"""slime's and vllm-project/vime's surface as a `vime.dialect.Dialect`: what the entry points hand the
core (`SLIME`), so that run scripts and plug-ins written for them run on vime as they are.

* Flags: Megatron's and slime's that vime keeps no setting for (`FLAGS`: checked against the
  checkpoint, mapped, or named at start-up), with what each is in slime for those it refuses.
* Plug-in paths: slime's spellings of vime's functions become vime's (`translate`), so a run's
  checks see the function the path names.
* Plug-in imports: `slime.*` and vllm-project/vime's module paths (`imports.py`), installed in every
  process the config reaches (a pickled `SLIME` installs them where it is loaded).
* Services: the router custom generate functions post to (`router.py`: vLLM's route for
  vllm-project/vime's, SGLang's `/generate` for slime's), and the names they read on `args`
  (`vllm_router_ip`, `vllm_router_port`, `sglang_router_ip`, `sglang_router_port`,
  `context_parallel_size`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from vime.compat import imports, model, parse, startup
from vime.compat.answer_log import AnswerLog
from vime.compat.flags import ACCEPTED
from vime.compat.router import Router
from vime.compat.sglang_api import DEFAULT_SERVER_CONCURRENCY
from vime.compat.sglang_flags import server_concurrency
from vime.dialect import PluginServices
from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN, SFT_ROLLOUT_FN, custom_rollout
from vime.plugins import IMPORT_EXPLAINERS, OPD_POST_PROCESS, OPD_REWARD

# what slime's GenerateState adds to the rollout's sampling params (besides skip_special_tokens)
TEXT_OPTIONS = {"no_stop_trim": True, "spaces_between_special_tokens": False}

# slime's (and vllm-project/vime's) spellings of vime's functions, by the flags that name functions
PATHS = {
    "vime.rollout.vllm_rollout.generate_rollout": DEFAULT_ROLLOUT_FN,
    "slime.rollout.vllm_rollout.generate_rollout": DEFAULT_ROLLOUT_FN,
    "slime.rollout.sglang_rollout.generate_rollout": DEFAULT_ROLLOUT_FN,
    "vime.rollout.sglang_rollout.generate_rollout": DEFAULT_ROLLOUT_FN,
    # slime.X is vime.X (imports.py): said here too, so the run's mode is read off vime's name
    "slime.rollout.fully_async_rollout.generate_rollout_fully_async": FULLY_ASYNC_FN,
    # slime's SFT scripts name it so: the run is an SFT run (its checks, no engine), not a rollout of one's own
    "slime.rollout.sft_rollout.generate_rollout": SFT_ROLLOUT_FN,
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
    itself (behind the run's own key, when it has one), and what its answers' log-probs are kept
    in for the samples a plug-in rebuilds."""

    def __init__(self, cfg: Any, runtime: Any) -> None:
        ro = cfg.rollout
        answers = AnswerLog() if ro.custom_generate_function_path else None  # only a custom generate gives them back
        self.router = Router(
            runtime,
            ro.rollout_max_response_len,
            model_path=str(ro.model_dir or ro.hf_checkpoint),
            api_key=cfg.placement.api_key,
            answers=answers,
        ).start()
        host, port = self.router.host, self.router.port
        pl = cfg.placement
        self.live = {
            "vllm_router_ip": host,
            "vllm_router_port": port,
            "sglang_router_ip": host,
            "sglang_router_port": port,
            # a count slime's args always hold (None is vime's "one engine"): strands-sglang's
            # `get_client_from_slime_args` sizes its pool as concurrency × rollout GPUs ÷ GPUs per engine
            "rollout_num_gpus": pl.rollout_num_gpus or len(runtime.engines) * pl.rollout_num_gpus_per_engine,
            "sglang_server_concurrency": server_concurrency(cfg.slime_flags, DEFAULT_SERVER_CONCURRENCY),
            # slime fills it in when not given, and a rollout function copied from slime's asks the
            # data source for that many groups at a time; vime keeps None for "not given"
            "over_sampling_batch_size": ro.over_sampling_batch_size or ro.rollout_batch_size,
        }

    def restore(self, samples: list[Any]) -> None:
        if self.router.answers is not None:
            for s in samples:
                self.router.answers.restore(s)

    def refusals(self) -> tuple[int, str]:
        return self.router.refused, self.router.last_refusal

    def stop(self) -> None:
        self.router.stop()


class Slime:
    name = "slime"
    # what every plug-in's `args` has besides the settings: the router's address, by vLLM's and
    # SGLang's names (None where the run has none) and Megatron's context-parallel size (one:
    # vime never splits a sequence; retool sizes its context as context_parallel_size × max_tokens_per_gpu)
    plugin_names = {  # noqa: RUF012
        "vllm_router_ip": None,
        "vllm_router_port": None,
        "sglang_router_ip": None,
        "sglang_router_port": None,
        "context_parallel_size": 1,
        # vllm-project/vime's fully-async example reads both: its requests in flight per engine
        # (its default; vime's engines bound theirs by --engine-max-num-seqs), and whether the
        # rollout draws from the one data source of the run (vime's always does)
        "vllm_server_concurrency": 512,
        "rollout_global_dataset": True,
        # slime's --sglang-server-concurrency default, which its plug-ins' clients size their pools by
        "sglang_server_concurrency": DEFAULT_SERVER_CONCURRENCY,
        # slime's --ci-test, off: its own generate (which plug-ins copy) checks it first; vime runs no slime CI
        "ci_test": False,
        # slime flags vime refuses (docs/slime-flags.md), so never given here: None, their default in
        # slime, which a rollout or eval function copied from slime's sglang_rollout tests before use
        **dict.fromkeys(
            (
                "rollout_sample_filter_path",
                "rollout_all_samples_process_path",
                "buffer_filter_path",
                "custom_rollout_log_function_path",
                "custom_eval_rollout_log_function_path",
                "eval_reward_key",
                "eval_max_prompt_len",
                "multimodal_keys",
            )
        ),
    }

    @property
    def flags(self) -> Collection[str]:
        return ACCEPTED

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parse.add_arguments(parser)

    def take_flags(self, rest: list[str]) -> tuple[dict[str, Any], list[str]]:
        return parse.take_flags(rest)

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

    def plugin_sampling_params(self, args: Any) -> dict[str, Any]:
        """SGLang's text options as slime's GenerateState sets them (sglang_rollout.py), so a plug-in
        that posts its sampling params to the router's `/generate` gets slime's text back: the stop
        string kept (retool's and search-r1's tags), special tokens kept unless
        --rollout-skip-special-tokens."""
        return dict(TEXT_OPTIONS, skip_special_tokens=bool(getattr(args, "rollout_skip_special_tokens", False)))

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
    slime that stands in for vime's, Megatron's trainer side (slime's custom losses and hooks
    import it), or a slime or vllm-project/vime name vime lacks."""
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
    if top == "megatron" or any(e.name.startswith(f"{t}.backends.megatron_utils") for t in (imports.ALIAS, "vime")):
        return (
            f"imports {lacked}, which vime does not have: it is Megatron-LM's trainer side, and vime trains the HF "
            "model with FSDP2; a plug-in over Megatron's batches and logits (a custom loss, a pg-loss reducer, a "
            "Megatron hook) is written again for vime's hook of that job (docs/slime-flags.md says which)"
        )
    if top in (imports.ALIAS, "vime"):
        return (
            f"imports {lacked}, which vime does not have: docs/plugin-compat.md lists the slime and "
            "vllm-project/vime names vime has"
        )
    return None


SLIME = Slime()


def _loaded() -> Slime:
    SLIME.install()
    return SLIME
