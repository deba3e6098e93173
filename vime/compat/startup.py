"""What the start-up says of the foreign flags given: `checks` (the refusals `Config.validate`
adds, from the settings alone) and `notes` (one line per kind: what vime does with each flag, and
which have no effect).
"""

from __future__ import annotations

import os
from typing import Any

from vime.compat import sglang_flags
from vime.compat.flags import FLAGS
from vime.compat.parse import mapped_values

# the estimators whose returns slime builds from a per-token reward, into which --kl-coef puts its KL
REWARD_KL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def checks(cfg: Any) -> list[tuple[bool, str]]:
    """What `Config.validate` refuses of the foreign flags (the settings alone, no model)."""
    g = cfg.slime_flags
    out = []
    for name in (n for n in FLAGS if FLAGS[n].kind == "zero"):
        value = g.get(name)
        if value is not None and value != 0:
            out.append((True, f"{FLAGS[name].flag} {value}: {FLAGS[name].says}; use 0"))
    granularity, method = g.get("recompute_granularity"), g.get("recompute_method")
    if granularity not in (None, "full", "selective"):
        out.append((True, f"--recompute-granularity {granularity!r}: use full or selective"))
    if method not in (None, "uniform", "block"):
        out.append((True, f"--recompute-method {method!r}: use uniform or block"))
    if granularity == "full" and method is None:
        out.append(
            (True, "--recompute-granularity full needs --recompute-method uniform (every layer) or block (the first N)")
        )
    if method == "block" and not g.get("recompute_num_layers"):
        out.append((True, "--recompute-method block needs --recompute-num-layers N (the first N layers recompute)"))
    for name in FLAGS:
        if FLAGS[name].kind == "parallel" and g.get(name) is not None and g[name] < 1:
            out.append((True, f"{FLAGS[name].flag} {g[name]}: sizes are at least 1"))
    return out + _kl_coef_checks(cfg)


def _kl_coef_checks(cfg: Any) -> list[tuple[bool, str]]:
    """slime's --kl-coef: refused where it would change training (a REINFORCE++ estimator, whose
    per-token reward it enters) and where slime refuses it (beside --kl-loss-coef)."""
    coef = cfg.slime_flags.get("kl_coef") or 0.0
    return [
        (
            coef != 0 and cfg.advantage_estimator in REWARD_KL_ESTIMATORS,
            f"--kl-coef {coef} with --advantage-estimator {cfg.advantage_estimator}: slime subtracts {coef} × "
            "KL(policy ‖ reference) from every token's reward before REINFORCE++'s returns, which vime does not do "
            f"yet: use --kl-loss-coef {coef} (the same KL as a loss term), or --kl-coef 0",
        ),
        (
            coef != 0 and cfg.kl_loss_coef != 0,
            f"--kl-coef {coef} and --kl-loss-coef {cfg.kl_loss_coef}: slime takes only one of them, and vime has "
            "the loss term only: drop --kl-coef",
        ),
    ]


def notes(cfg: Any) -> tuple[list[str], list[str]]:
    """The start-up lines saying what vime does with each foreign flag given, each flag listed once,
    and the foreign flags with no effect (vime's own join them on one line: vime/preflight.py)."""
    g = cfg.slime_flags
    out = []
    sizes = {n: g[n] for n in FLAGS if FLAGS[n].kind == "parallel" and n in g}
    if sizes or g.get("sequence_parallel"):
        given = " ".join(f"{FLAGS[n].flag} {v}" for n, v in sizes.items())
        out.append(f"Megatron's parallel sizes ({given or 'none'}): {_sharding(cfg)}")
    recompute = " ".join(f"{FLAGS[n].flag} {g[n]}" for n in FLAGS if FLAGS[n].kind == "recompute" and n in g)
    if g.get("recompute_granularity") == "full":
        layers = g.get("recompute_num_layers") if g.get("recompute_method") == "block" else None
        out.append(
            f"{recompute}: activation checkpointing of "
            + (f"the first {layers} decoder layers" if layers else "every decoder layer")
        )
    mapped, same, inert = _by_value(cfg)
    if g.get("_opd_estimator"):
        mapped.append(
            f"--advantage-estimator on_policy_distillation → --advantage-estimator {cfg.advantage_estimator} "
            f"--use-opd --opd-type {cfg.opd_type} (slime's earlier on-policy distillation: the teacher's log-prob "
            "minus the policy's on every token, from the log-probs the post-process stores; the rewards it "
            "returns are GRPO's, 0 in slime's example)"
        )
    if g.get("_engine_tensor_parallel"):
        mapped.append(
            f"--rollout-num-gpus-per-engine {g['_engine_tensor_parallel']} → 1 (the built-in engine has no tensor "
            "parallelism: each rollout GPU runs an engine of its own, the whole model on it; --rollout-backend vllm "
            "splits engines over GPUs)"
        )
    if mapped:
        out.append("slime flags that set vime's: " + "; ".join(mapped))
    same += [f"{FLAGS[n].flag} ({FLAGS[n].says})" for n in g if n in FLAGS and FLAGS[n].kind == "same"]
    same += [f"{FLAGS[n].flag} 0 ({FLAGS[n].says})" for n in g if n in FLAGS and FLAGS[n].kind == "zero"]
    if same:
        out.append("slime/Megatron flags vime always follows: " + "; ".join(same))
    inert += [f"{FLAGS[n].flag}{_shown(g[n])} ({FLAGS[n].says})" for n in g if n in FLAGS and FLAGS[n].kind == "inert"]
    if g.get("recompute_granularity") == "selective":
        inert.append(f"{recompute} (selective recompute saves the attention scores, which vime's kernel never stores)")
    elif recompute and g.get("recompute_granularity") is None:
        inert.append(f"{recompute} (no recompute without --recompute-granularity)")
    if "_ignored_micro_batch_size" in g:
        inert.append(
            f"--micro-batch-size {g['_ignored_micro_batch_size']} (slime reads it only without --use-dynamic-batch-size)"
        )
    return out, inert


def _shown(value: Any) -> str:
    if value is True:
        return ""
    return " " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))


def _sharding(cfg: Any) -> str:
    """What vime does instead of Megatron's parallel sizes, over the trainer ranks this run has:
    one rank per actor GPU on CUDA, --actor-num-procs processes on CPU (a torchrun's WORLD_SIZE
    wins, as the trainer's own count: vime/trainer/distributed.py)."""
    from vime.backends.placement import trainer_device  # torch: only once a run starts, not for --help
    from vime.trainer.distributed import world_size

    device = trainer_device(cfg.placement)
    ranks = world_size(cfg.placement, device)
    where = f"{ranks} actor GPU(s)" if device.startswith("cuda") else f"{ranks} CPU trainer process(es)"
    if ranks == 1 and "WORLD_SIZE" not in os.environ:
        return (
            f"vime trains on one rank ({device}), the whole model there; with several it shards weights, gradients "
            "and AdamW state over them with FSDP2 instead, each a data-parallel rank; a sequence is never split"
        )
    return (
        f"vime shards weights, gradients and AdamW state over its {where} with FSDP2 instead, each a data-parallel "
        "rank; a sequence is never split over them (--max-tokens-per-gpu bounds each micro-batch)"
    )


def _by_value(cfg: Any) -> tuple[list[str], list[str], list[str]]:
    """The flags whose effect depends on the value given (`value` rows and slime's `--sglang-*`):
    (set a vime setting, vime always does it, no effect), each as a start-up line's item."""
    g = cfg.slime_flags
    mapped, same, inert = [], [], []
    for name, setting, value in mapped_values(g):
        mapped.append(_set(f"{FLAGS[name].flag} {g[name]}", setting, value, getattr(cfg, setting)))
    coef = g.get("kl_coef")
    if coef == 0:
        same.append("--kl-coef 0 (no KL penalty in the reward)")
    elif coef is not None and cfg.advantage_estimator not in REWARD_KL_ESTIMATORS:
        inert.append(
            f"--kl-coef {coef} (slime computes the KL with --advantage-estimator {cfg.advantage_estimator} too, "
            "and its returns leave it out: only REINFORCE++'s and PPO's rewards take it)"
        )
    mode = g.get("update_weight_mode")
    if mode == "full":
        same.append("--update-weight-mode full (the whole weights at every push)")
    elif mode is not None:
        inert.append(f"--update-weight-mode {mode} ({FLAGS['update_weight_mode'].says})")
    transport = g.get("update_weight_transport")
    if transport not in (None, "disk"):
        inert.append(f"--update-weight-transport {transport} (vime picks the transport per engine: --weight-transport)")
    chunk = g.get("log_probs_chunk_size")
    if chunk is not None and chunk <= 0:
        inert.append(
            f"--log-probs-chunk-size {chunk} (vime computes log-probs in chunks of --logprob-chunk-size tokens)"
        )
    effects = sglang_flags.effects(g, cfg.rollout_backend, starts_engines=not cfg.rollout_engine_urls)
    for e in effects:
        if e.setting is not None:
            mapped.append(_set(e.flag, e.setting[0], e.setting[1], getattr(cfg, e.setting[0])))
        if e.vllm is not None:
            name, value = e.vllm
            mapped.append(_set(e.flag, f"vllm-{name}", value, cfg.vllm_args.get(name)))
        if e.kind == "mapped":
            continue
        if e.kind == "same":
            same.append(f"{e.flag} ({e.why})")
        else:
            inert.append(f"{e.flag} ({e.why})")
    return mapped, same, inert


def _set(given: str, setting: str, value: Any, now: Any) -> str:
    """`given` → the vime flag it set, or what the flag the user gave set instead."""
    flag = "--" + setting.replace("_", "-")
    if now != value:
        return f"{given} → {flag}, which you gave as {_shown(now).strip() or 'a switch'}: yours holds"
    return f"{given} → {flag}{_shown(value)}"
