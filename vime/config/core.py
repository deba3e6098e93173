"""`Config`: the settings of vime/config/schema.py with their validation (every consistency
check of the settings runs from `validate`) and the run's copies (config.yaml, the pickle a
trainer rank is spawned with, a plug-in's deepcopy)."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

from vime.config import checks_common, checks_train, corrections
from vime.config.custom_file import apply_custom_config
from vime.config.eval_sets import resolve
from vime.config.schema import FIELDS, Settings
from vime.errors import ConfigError
from vime.modes import DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN
from vime.setting import RUNTIME

# what a frozen config keeps in its __dict__ besides the settings: the mark, and the component
# views built under it (schema.Settings._view keeps them in `_views`); no copy takes them, since a
# copy may be changed
NOT_COPIED = ("_frozen", "_views")
ENTRIES = ("sync", "async", "eval")  # train.py, train_async.py, vime eval


@dataclass
class Config(Settings):
    """One typed config for every entry point; `parse_args` builds and validates it."""

    def validate(self, entry: str = "sync") -> Config:
        """Fail at start-up, not an hour in; fill in the defaults that depend on other fields and
        the derived `mode`. `entry`: sync (train.py), async (train_async.py) or eval (`vime eval`,
        which checks only what evaluation needs). Every consistency check of the settings is here."""
        if entry not in ENTRIES:
            raise ValueError(f"validate(entry={entry!r}): one of {ENTRIES}")
        if self.custom_config_path is not None:
            apply_custom_config(self)  # slime applies it first: its keys override the flags
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        if self.sft_rollout and self.n_samples_per_prompt == FIELDS["n_samples_per_prompt"].default:
            self.n_samples_per_prompt = 1  # slime's default: SFT trains each conversation once
        steps = self.num_steps_per_rollout
        if steps is not None and steps >= 1 and self.samples_per_rollout % steps == 0:
            gbs = self.samples_per_rollout // steps
            if self.global_batch_size not in (None, gbs):
                raise ConfigError(
                    f"--num-steps-per-rollout {steps} makes the global batch {gbs} samples, but --global-batch-size is "
                    f"{self.global_batch_size}: give only one of them"
                )
            self.global_batch_size = gbs
        if self.global_batch_size is None:
            self.global_batch_size = self.samples_per_rollout
        self._count_steps()
        if self.eval_max_response_len is None:
            self.eval_max_response_len = self.rollout_max_response_len
        checks = []
        for name, f in FIELDS.items():  # argparse checks choices on the command line; a YAML value gets here unchecked
            value, choices = getattr(self, name), f.metadata["choices"]
            if choices is not None and value is not None and value not in choices:
                checks.append((True, f"--{name.replace('_', '-')} {value!r}: use one of {', '.join(choices)}"))
        checks += checks_common.common_checks(self) + (
            checks_train.eval_checks(self) if entry == "eval" else checks_train.train_checks(self, entry)
        )
        for bad, msg in checks:
            if bad:
                raise ConfigError(msg)
        self.eval_sets = resolve(self)
        if self.load_debug_rollout_data is not None or self.sft_rollout:
            # slime's rule: saved rollouts, or the data's own conversations, stand in for the engines
            self.debug_train_only = True
        if entry != "eval":
            self.mode = self._derive_mode(entry)
            corrections.resolve_correction(self)
            if self.over_sampling_batch_size is not None and self.rollout_function_path == FULLY_ASYNC_FN:
                raise ConfigError(
                    f"--over-sampling-batch-size is the sync batch's round of prompts; the fully-async worker ({self.mode}) "
                    "keeps --rollout-concurrency groups in flight instead: give that, or drop the flag"
                )
            if self.partial_rollout:
                self.update_in_flight = "resume"
            self.partial_rollout = self.update_in_flight == "resume"  # slime's name, for plug-ins that read it
            if self.update_in_flight != "keep" and self.rollout_function_path != FULLY_ASYNC_FN:
                raise ConfigError(
                    f"--update-in-flight {self.update_in_flight} acts on the fully-async worker's groups, and this run "
                    f"({self.mode}) has nothing in flight at a push: use the fully-async rollout function or --max-staleness K"
                )
            if self.tis_level != "token" and not self.use_tis:
                raise ConfigError(
                    f"--tis-level {self.tis_level} weighs TIS per sequence, and this run has no TIS "
                    f"(off-policy correction: {self.off_policy_correction}): add --use-tis, or drop --tis-level"
                )
            if self.run_name is None:  # a run needs its directory's name from the start (locks, logs)
                self.run_name = time.strftime("%Y%m%d-%H%M%S") + f"-{self.mode}"
        if self.api_key is None:
            self.api_key = os.environ.get("VIME_API_KEY") or None
        return self

    def __post_init__(self) -> None:
        self._count_steps()  # a config made directly (a test's, a plug-in's copy) has it too

    def _count_steps(self) -> None:
        """The trainer's optimizer steps per rollout, from the batch sizes; max(1, ...): a zero
        batch size is reported by the checks in one line, not divided by here."""
        gbs = self.global_batch_size or self.samples_per_rollout
        self.steps_per_rollout = self.samples_per_rollout // max(1, gbs)

    def _derive_mode(self, entry: str) -> str:
        """The one place the training mode is decided. train_async.py with --max-staleness is
        decoupled, which needs the continuous worker: the default rollout function becomes the
        fully-async one; a rollout function of one's own runs one-step-off, overlapping only as
        far as --max-staleness allows. The names are rows of `vime.modes.MODES`."""
        if entry == "sync" or self.sft_rollout:  # SFT generates nothing: there is nothing to overlap
            return "sync"
        if self.max_staleness is not None:
            if self.rollout_function_path == DEFAULT_ROLLOUT_FN:
                self.rollout_function_path = FULLY_ASYNC_FN
            return "decoupled" if self.rollout_function_path == FULLY_ASYNC_FN else "one-step-off"
        return "fully-async" if self.rollout_function_path == FULLY_ASYNC_FN else "one-step-off"

    def correction_summary(self) -> str:
        """One line for the start of a run: which correction, and what it does to a token."""
        return corrections.correction_summary(self)

    def to_dict(self) -> dict[str, Any]:
        """Every setting and derived value, for config.yaml; a secret shows only that it was set."""
        d = {name: copy.deepcopy(getattr(self, name)) for name, f in FIELDS.items() if f.metadata["group"] != RUNTIME}
        for secret in ("api_key", "wandb_key"):
            if d[secret]:
                d[secret] = "<set>"
        return d

    def __getstate__(self) -> dict[str, Any]:
        """Trainer ranks are spawned with the config: the live objects stay in this process."""
        return {**{k: v for k, v in self.__dict__.items() if k != "_views"}, "runtime": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> Config:
        """The settings copied, the live objects shared: a plug-in that copies `args` to change a
        few settings for itself (vllm-project/vime's multi-agent example) still reaches the run's engines."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            if name not in NOT_COPIED:
                setattr(clone, name, value if name in ("runtime", "dialect") else copy.deepcopy(value, memo))
        return clone

    # ---- frozen once the run is assembled (vime/launch/assemble.py) ----

    def freeze(self) -> Config:
        """From now on every attribute write raises: the run's settings are fixed once it is
        assembled, and its live objects (engines, runtime, router) are in its RunContext. The mark
        is this object's alone: a copy (copy.copy, deepcopy, `derived`) can be changed; a trainer
        rank's pickle keeps it."""
        self.__dict__["_frozen"] = True
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name in NOT_COPIED:  # the frozen mark and the views kept under it: a copy is not frozen
            return
        if "_frozen" in self.__dict__:
            raise dataclasses.FrozenInstanceError(
                f"args.{name}: the run's config is frozen once the run is assembled; live state belongs in "
                "RunContext (vime/launch/context.py), a changed setting in a copy (Config.derived)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if "_frozen" in self.__dict__:  # `del args.lr` would fall back to the class default
            raise dataclasses.FrozenInstanceError(f"args.{name}: the run's config is frozen once the run is assembled")
        object.__delattr__(self, name)

    def __copy__(self) -> Config:
        """The settings, not frozen, the live runtime dropped (as a pickle drops it)."""
        clone = object.__new__(type(self))
        clone.__dict__.update({k: v for k, v in self.__getstate__().items() if k not in NOT_COPIED})
        return clone

    def derived(self, **changes: Any) -> Config:
        """A new config with `changes` (dataclasses.replace): how a value found after validation
        (the model's directory, --num-epoch's rollouts) joins the run's config without a write
        into it. The attributes --custom-config-path gave plug-ins come along."""
        clone = dataclasses.replace(self, **changes)
        clone.__dict__.update({k: v for k, v in self.__dict__.items() if k not in FIELDS and k not in NOT_COPIED})
        return clone
