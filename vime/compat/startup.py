"""What the start-up says of the foreign flags given: `checks` (the refusals `Config.validate`
adds, from the settings alone) and `notes` (one line per kind: what vime does with each flag, and
which have no effect).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vime.compat.flags import FLAGS

# What the built-in engine has in place of a vLLM engine argument, for the start-up line.
VLLM_COUNTERPARTS = {
    "gpu-memory-utilization": "--engine-num-kv-blocks",
    "max-num-seqs": "--engine-max-num-seqs",
    "quantization": "--engine-quantization",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
}


def checks(cfg: Any) -> list[tuple[bool, str]]:
    """What `Config.validate` refuses of the foreign flags (the settings alone, no model)."""
    g = cfg.slime_flags
    out = []
    for name in ("attention_dropout", "hidden_dropout"):
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
    return out


def notes(cfg: Any, inert_own: Sequence[str] = ()) -> list[str]:
    """The start-up lines: what vime does with each foreign flag given, each flag listed once;
    `inert_own`, vime's own flags with no effect under the other settings
    (`config.checks_train.inert_flags`), join the foreign ones' "no effect" line."""
    g = cfg.slime_flags
    out = []
    sizes = {n: g[n] for n in FLAGS if FLAGS[n].kind == "parallel" and n in g}
    if sizes or g.get("sequence_parallel"):
        gpus = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        given = " ".join(f"{FLAGS[n].flag} {v}" for n, v in sizes.items())
        out.append(
            f"Megatron's parallel sizes ({given or 'none'}): vime shards weights, gradients and AdamW state over all "
            f"{gpus} actor GPU(s) with FSDP2 instead, each GPU a data-parallel rank; a sequence is never split over "
            "GPUs (--max-tokens-per-gpu bounds each micro-batch)"
        )
    recompute = " ".join(f"{FLAGS[n].flag} {g[n]}" for n in FLAGS if FLAGS[n].kind == "recompute" and n in g)
    if g.get("recompute_granularity") == "full":
        layers = g.get("recompute_num_layers") if g.get("recompute_method") == "block" else None
        out.append(
            f"{recompute}: activation checkpointing of "
            + (f"the first {layers} decoder layers" if layers else "every decoder layer")
        )
    same = [f"{FLAGS[n].flag} ({FLAGS[n].says})" for n in g if n in FLAGS and FLAGS[n].kind == "same"]
    same += [f"{FLAGS[n].flag} 0 ({FLAGS[n].says})" for n in g if n in FLAGS and FLAGS[n].kind == "zero"]
    if same:
        out.append("slime/Megatron flags vime always follows: " + "; ".join(same))
    inert = [*inert_own]
    inert += [
        f"{FLAGS[n].flag}{'' if g[n] is True else f' {g[n]}'} ({FLAGS[n].says})"
        for n in g
        if n in FLAGS and FLAGS[n].kind == "inert"
    ]
    if g.get("recompute_granularity") == "selective":
        inert.append(f"{recompute} (selective recompute saves the attention scores, which vime's kernel never stores)")
    elif recompute and g.get("recompute_granularity") is None:
        inert.append(f"{recompute} (no recompute without --recompute-granularity)")
    if "_ignored_micro_batch_size" in g:
        inert.append(
            f"--micro-batch-size {g['_ignored_micro_batch_size']} (slime reads it only without --use-dynamic-batch-size)"
        )
    for name, value in cfg.vllm_args.items():
        if cfg.rollout_backend != "vllm":
            instead = VLLM_COUNTERPARTS.get(name)
            why = "no vLLM engine: --rollout-backend is vime" + (f"; its counterpart: {instead}" if instead else "")
        elif cfg.rollout_engine_urls:
            why = "vime starts no vLLM server with --rollout-engine-urls: start yours with it"
        else:
            continue
        inert.append(f"--vllm-{name} {value} ({why})")
    if cfg.tool_key and not cfg.apply_chat_template:
        inert.append(
            f"--tool-key {cfg.tool_key} for the prompt (no --apply-chat-template; rewards still see the tools)"
        )
    if cfg.use_kl_loss and cfg.kl_loss_coef == 0:
        inert.append("--use-kl-loss with --kl-loss-coef 0 (no KL term: no reference model is loaded)")
    if cfg.ref_load and cfg.kl_loss_coef == 0:
        inert.append(f"--ref-load {cfg.ref_load} (not read: --kl-loss-coef 0 needs no reference model)")
    if inert:
        out.append("flags with no effect in vime: " + "; ".join(inert))
    if cfg.custom_config_path:
        extras = ", ".join(cfg.custom_config) or "none"
        out.append(
            f"--custom-config-path {cfg.custom_config_path}: its settings override the flags (config.yaml has the result); "
            f"its other keys, attributes of args for plug-ins: {extras}"
        )
    return out
