"""What the start-up says of the foreign flags given: `checks` (the refusals `Config.validate`
adds, from the settings alone) and `notes` (one line per kind: what vime does with each flag, and
which have no effect).
"""

from __future__ import annotations

from typing import Any

from vime.compat.flags import FLAGS


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
    return out


def notes(cfg: Any) -> tuple[list[str], list[str]]:
    """The start-up lines saying what vime does with each foreign flag given, each flag listed once,
    and the foreign flags with no effect (vime's own join them on one line: vime/preflight.py)."""
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
    inert = [
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
    return out, inert
