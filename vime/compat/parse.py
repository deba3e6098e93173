"""slime's flags on vime's command line: `add_arguments` for those of `FLAGS`, `take_flags` for
the `--sglang-*` family, one error naming every flag vime does not know (with what it is in
slime), and `translate`, which turns the foreign flags that have a vime setting into it.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from vime.compat import sglang_flags
from vime.compat.absent_flags import ABSENT_DOC, OPSD, absent
from vime.compat.flags import FLAGS
from vime.config.schema import default_of
from vime.errors import ConfigError


def unknown_flags_error(rest: list[str], known: list[str]) -> str | None:
    """One message for every flag of `rest` (what argparse did not take) that vime does not know,
    one line each with what it is in slime and what vime has instead (`known`: vime's own flags,
    for a suggestion); None when `rest` holds none. A flag's values go with it; a value with no
    flag before it is named too."""
    lines, flag = [], None
    for tok in rest:
        is_flag = tok.startswith("-") and len(tok) > 1 and not tok[1].isdigit() and tok[1] != "."
        if not is_flag:
            if flag is None:
                lines.append(f"  {tok!r}: a value with no flag before it")
            continue
        flag = tok.split("=", 1)[0]
        dest = flag.lstrip("-").replace("-", "_")
        row = absent(dest)
        if row is not None:
            lines.append(f"  {flag} (slime): {row.says}")
            continue
        close = difflib.get_close_matches(flag, known, n=1)
        lines.append(f"  {flag}: neither a vime nor a slime flag" + (f" (did you mean {close[0]}?)" if close else ""))
    if not lines:
        return None
    n = sum(not line.endswith("a value with no flag before it") for line in lines)
    count = f" ({n} flag{'s' if n != 1 else ''} vime does not know)" if n else ""
    return (
        f"unrecognized arguments: {' '.join(rest)}{count}:\n"
        + "\n".join(lines)
        + f"\n  (what vime does with each slime flag: {ABSENT_DOC})"
    )


# slime's earlier on-policy distillation, an advantage estimator of its own (its
# examples/on_policy_distillation scripts pass it); slime later made it `--use-opd --opd-type sglang`
OPD_ESTIMATOR = "on_policy_distillation"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # slime's values of vime's flags: taken here, so `translate` says what each is rather than
    # argparse refusing the choice without a word
    for flag, value in (("--advantage-estimator", OPD_ESTIMATOR), ("--opd-type", "self")):
        action = next(a for a in parser._actions if flag in a.option_strings)
        action.choices = [*action.choices, value]
    group = parser.add_argument_group(
        "slime/Megatron compatibility", "flags of slime's run scripts; vime has no setting of its own for them"
    )
    for f in FLAGS.values():
        if f.type is bool:
            group.add_argument(f.flag, dest=f.name, action="store_true", default=argparse.SUPPRESS, help=f.says)
        else:
            group.add_argument(
                f.flag,
                dest=f.name,
                type=f.type,
                nargs=f.nargs,
                metavar=f.type.__name__.upper(),
                default=argparse.SUPPRESS,
                help=f.says,
            )
    group.add_argument(
        "--sglang-NAME",
        dest="sglang_NAME",
        metavar="VALUE",
        default=argparse.SUPPRESS,
        help="any argument of the SGLang servers slime starts (e.g. --sglang-mem-fraction-static 0.7): the vime "
        "setting or vLLM server argument that does the same where there is one, else named at start-up "
        "(docs/slime-flags.md)",
    )


def take_flags(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """slime's `--sglang-*` flags of what argparse left, as {dest: value}; the other tokens."""
    return sglang_flags.take(rest)


def translate(values: dict[str, Any]) -> None:
    """Turn the foreign flags in `values["slime_flags"]` into vime settings, in place, where vime
    has one; a vime flag the user gave explicitly wins."""
    given = values.get("slime_flags") or {}
    if values.get("opd_type") == "self":
        raise ConfigError(f"--opd-type self: {OPSD}")
    if values.get("advantage_estimator") == OPD_ESTIMATOR:
        # the teacher's log-prob minus the policy's on every token, from the log-probs the
        # post-process stores: vime's served-teacher OPD term over GRPO's advantages, which the
        # post-process's zero rewards leave at 0
        values.update(advantage_estimator="grpo")
        values.setdefault("use_opd", True)
        values.setdefault("opd_type", "sglang")
        given["_opd_estimator"] = True
        values["slime_flags"] = given
    granularity = given.get("recompute_granularity")
    if granularity == "full":
        values.setdefault("gradient_checkpointing", True)
        if given.get("recompute_method") == "block" and given.get("recompute_num_layers"):
            values.setdefault("gradient_checkpointing_layers", given["recompute_num_layers"])
    if given.get("use_dynamic_batch_size") and values.get("micro_batch_size") is not None:
        # slime reads --micro-batch-size only without --use-dynamic-batch-size
        given["_ignored_micro_batch_size"] = values.pop("micro_batch_size")
    for _flag, setting, value in mapped_values(given):
        values.setdefault(setting, value)
    backend = values.get("rollout_backend") or default_of("rollout_backend")
    per_engine = values.get("rollout_num_gpus_per_engine") or 1
    if backend == "vime" and per_engine > 1 and any(name.startswith(sglang_flags.PREFIX) for name in given):
        # a slime script's SGLang engines of N GPUs each (tensor parallel): the built-in engine
        # has no tensor parallelism, so the same GPUs run one engine each (said at start-up;
        # check_model refuses a model whose weights cannot fit one GPU)
        values["rollout_num_gpus_per_engine"] = 1
        if values.get("rollout_num_engines") is not None:
            values["rollout_num_engines"] *= per_engine
        given["_engine_tensor_parallel"] = per_engine
        values["slime_flags"] = given
    for effect in sglang_flags.effects(given, backend, starts_engines=not values.get("rollout_engine_urls")):
        if effect.setting is not None:
            values.setdefault(*effect.setting)
        if effect.vllm is not None:
            values.setdefault("vllm_args", {}).setdefault(*effect.vllm)


def mapped_values(given: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """slime's `value` flags that become a vime setting at the value given: (flag name, setting,
    value). --update-weight-transport disk writes the weights to disk as vime's disk transport
    does; --log-probs-chunk-size N chunks log-probs by N tokens as --logprob-chunk-size does (-1,
    slime's whole sequence, is vime's default chunking, said at start-up)."""
    out = []
    if given.get("update_weight_transport") == "disk":
        out.append(("update_weight_transport", "weight_transport", "disk"))
    chunk = given.get("log_probs_chunk_size")
    if chunk is not None and chunk > 0:
        out.append(("log_probs_chunk_size", "logprob_chunk_size", chunk))
    return out
