"""slime's and Megatron's flags that vime keeps no setting of its own for.

Users bring run scripts written for slime (and for the seed system built on it): a `MODEL_ARGS`
block of Megatron's model-shape flags, Megatron's parallel sizes, recompute and kernel switches.
vime trains the HF checkpoint itself with FSDP2, so none of these is a setting here, and none may
be dropped silently either. Each is one row of `FLAGS` that says what vime does with it:

  shape     checked against the checkpoint (config.json, weight names) before anything starts;
            a contradiction is a one-line error naming both values
  parallel  Megatron's model-parallel sizes: vime shards over every actor GPU with FSDP2 instead,
            said in one start-up line; what cannot be honoured is refused
  recompute becomes vime's activation checkpointing
  same      what vime always does: listed once at start-up
  inert     no effect in vime: listed once at start-up, with the reason
  zero      accepted at 0 (what vime does), refused otherwise with the reason

`--vllm-NAME VALUE` flags are collected apart (`Config.vllm_args`): arguments of the vLLM servers
vime starts, listed as having no effect with the built-in engine. docs/slime-flags.md is the
table of every flag of the seed's scripts and what vime does with it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One foreign flag. `type` bool is a switch (store_true)."""

    name: str  # the dest, e.g. tensor_model_parallel_size
    kind: str  # shape | parallel | recompute | same | inert | zero
    type: type
    says: str  # what vime does with it: the start-up line, the --help and docs/slime-flags.md

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _rows(kind: str, type_: type, says: str, *names: str) -> list[Flag]:
    return [Flag(n, kind, type_, says) for n in names]


_CHECKED = "checked against the checkpoint's config.json and weights"
FLAGS: dict[str, Flag] = {
    f.name: f
    for f in [
        *_rows(
            "shape",
            int,
            _CHECKED,
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "vocab_size",
            "max_position_embeddings",
        ),
        *_rows("shape", float, _CHECKED, "rotary_base", "norm_epsilon", "rotary_percent"),
        *_rows("shape", str, _CHECKED, "normalization", "position_embedding_type"),
        *_rows(
            "shape",
            bool,
            _CHECKED,
            "swiglu",
            "group_query_attention",
            "qk_layernorm",
            "add_qkv_bias",
            "disable_bias_linear",
            "untie_embeddings_and_output_weights",
            "use_rotary_position_embeddings",
        ),
        *_rows(
            "parallel",
            int,
            "vime shards weights, gradients and optimizer state over every actor GPU with FSDP2",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        ),
        Flag("sequence_parallel", "inert", bool, "no tensor parallelism to pair it with: FSDP2 instead"),
        Flag("recompute_granularity", "recompute", str, "full: --gradient-checkpointing"),
        Flag("recompute_method", "recompute", str, "uniform: every layer; block: --gradient-checkpointing-layers"),
        Flag("recompute_num_layers", "recompute", int, "with block: --gradient-checkpointing-layers"),
        Flag("use_dynamic_batch_size", "same", bool, "micro-batches are always packed up to --max-tokens-per-gpu"),
        Flag(
            "balance_data", "same", bool, "each step's samples are always split over trainer ranks balanced by tokens"
        ),
        Flag("accumulate_allreduce_grads_in_fp32", "same", bool, "FSDP2 reduces gradients in float32"),
        Flag("attention_softmax_in_fp32", "same", bool, "the attention kernels keep the softmax in float32"),
        Flag("attention_backend", "inert", str, "vime's packed attention chooses its kernel itself"),
        Flag("train_backend", "inert", str, "vime trains with FSDP2: the same model and loss"),
        Flag("train_memory_margin_bytes", "inert", int, "vime's trainer reserves no memory margin"),
        Flag("disable_wandb_random_suffix", "same", bool, "the W&B run id is the run name, no random suffix"),
        Flag("wandb_always_use_train_step", "same", bool, "W&B rows are logged at the training step"),
        Flag("seq_length", "inert", int, "sequence lengths come from the data"),
        Flag(
            "use_fault_tolerance",
            "same",
            bool,
            "engines that die or fall silent are always found (--rollout-health-check-*) and those vime launched restarted",
        ),
        Flag(
            "rollout_health_check_first_wait",
            "inert",
            float,
            "an engine is probed only once it has answered at start-up, so a slow first load never counts against it",
        ),
        Flag("make_vocab_size_divisible_by", "inert", int, "vime keeps the checkpoint's vocabulary"),
        *_rows(
            "zero",
            float,
            "vime trains without dropout, which would make the trainer's log-probs differ from the engine's",
            "attention_dropout",
            "hidden_dropout",
        ),
    ]
}


def _absent(says: str, *names: str) -> list[Flag]:
    return [Flag(n, "absent", str, says) for n in names]


# slime's flags that vime does not accept (not parsed, so argparse leaves them over): what each
# is in slime and what vime has instead, for the one error that lists every flag a command line
# has that vime does not know. A name ending in * is a family of flags.
_NOT_YET = "not in vime yet"
ABSENT: dict[str, Flag] = {
    f.name: f
    for f in [
        *_absent(
            "a function from the rollout's rewards to the trained ones; vime: --custom-advantage-function-path sees every group's rewards",
            "custom_reward_post_process_path",
        ),
        *_absent("image/video columns for vision-language models; vime trains text models only", "multimodal_keys"),
        *_absent("a KL penalty folded into the reward; vime: --kl-loss-coef (the KL as a loss term)", "kl_coef"),
        *_absent("the request router in front of slime's engines; vime's client spreads requests itself", "router_*"),
        *_absent(
            "GPUs per node of the cluster; vime: --actor-num-gpus-per-node and --rollout-num-gpus", "num_gpus_per_node"
        ),
        *_absent(
            "how Megatron's weights become HF ones for the engines; vime trains the HF model itself",
            "megatron_to_hf_mode",
        ),
        *_absent(
            "delta weight sync through a shared disk; vime pushes whole weights, by --weight-transport",
            "update_weight_mode",
            "update_weight_transport",
            "update_weight_disk_dir",
            "update_weight_disk_keep_files",
            "update_weight_local_checkpoint_dir",
            "update_weight_delta_encoding",
            "update_weight_delta_checksum",
            "custom_update_weight_post_write_path",
        ),
        *_absent(
            "Megatron's optimizer state on the CPU or in low precision; vime: FSDP2 shards it over the actor GPUs",
            "optimizer_cpu_offload",
            "overlap_cpu_optimizer_d2h_h2d",
            "use_precision_aware_optimizer",
        ),
        *_absent(
            "an argument of the SGLang servers slime starts; vime: --vllm-NAME with --rollout-backend vllm, "
            "or the built-in engine's --engine-* flags",
            "sglang_*",
        ),
        *_absent("engines started elsewhere; vime: --rollout-engine-urls", "rollout_external_engine_addrs"),
        *_absent(
            "memory offload while colocated; vime: --colocate releases the engine's memory while the trainer steps",
            "offload",
            "offload_train",
            "offload_rollout",
            "release_train",
        ),
        *_absent(
            "a rollout function of eval's own; vime evaluates with the run's generate function (vime/eval.py)",
            "eval_function_path",
        ),
        *_absent("eval's tool schemas key; vime: --tool-key (training and eval)", "eval_tool_key"),
        *_absent("eval's reward key; vime grades eval by rm type rules (--eval-rm-type)", "eval_reward_key"),
        *_absent(
            "eval's prompt/context bounds; vime: --rollout-max-context-len bounds eval too, and prompts too long for the model are refused",
            "eval_max_prompt_len",
            "eval_max_context_len",
        ),
        *_absent("a minimum response length; vime's engines have none", "eval_min_new_tokens"),
        *_absent(
            "no reward normalization at all; vime: --disable-grpo-std-normalization drops the std only",
            "disable_rewards_normalization",
        ),
        *_absent(
            "PPO's critic; vime trains critic-free estimators (GRPO family, REINFORCE++)",
            "value_clip",
            "lambd",
            "num_critic_only_steps",
        ),
        *_absent("MoE routing replay; vime trains dense models", "use_routing_replay", "use_rollout_routing_replay"),
        *_absent("multi-token-prediction layers; not in vime", "enable_mtp_training", "mtp_*"),
        *_absent("slime's own CI checks; not in vime", "ci_*"),
        *_absent(
            "extra rollout logs (pass rate, multi-turn, samples); vime logs rollout/* and eval/* metrics itself",
            "log_passrate",
            "log_multi_turn",
            "log_correct_samples",
            "log_reward_category",
            "custom_rollout_log_function_path",
            "custom_eval_rollout_log_function_path",
        ),
        *_absent(
            "per-sample filters and hooks of slime's rollout buffer; vime: --dynamic-sampling-filter-path",
            "rollout_sample_filter_path",
            "rollout_all_samples_process_path",
            "buffer_filter_path",
        ),
        *_absent("a data source class of one's own; not in vime", "data_source_path"),
        *_absent("the first rollout's id; vime: --load resumes at its checkpoint's step", "start_rollout_id"),
        *_absent("HF-format saves; vime's checkpoints are HF directories already", "save_hf"),
        *_absent("compares pushed weights with the engine's; vime: --check-weight-push", "check_weight_update_equal"),
    ]
}
ABSENT_DOC = "docs/slime-flags.md"


def absent(dest: str) -> Flag | None:
    """The row of a slime flag vime does not accept (`dest`: e.g. opd_type), or None."""
    return ABSENT.get(dest) or next(
        (f for f in ABSENT.values() if f.name.endswith("*") and dest.startswith(f.name[:-1])), None
    )


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


# What the built-in engine has in place of a vLLM engine argument, for the start-up line.
VLLM_COUNTERPARTS = {
    "gpu-memory-utilization": "--engine-num-kv-blocks",
    "max-num-seqs": "--engine-max-num-seqs",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
                metavar=f.type.__name__.upper(),
                default=argparse.SUPPRESS,
                help=f.says,
            )
    group.add_argument(
        "--vllm-NAME",
        dest="_vllm_help",
        metavar="VALUE",
        default=argparse.SUPPRESS,
        help="any vLLM engine argument (e.g. --vllm-gpu-memory-utilization 0.5), passed to the vLLM servers vime starts",
    )


def split_vllm_args(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--vllm-NAME [VALUE ...]` tokens of what argparse did not know, as {NAME: value}; the
    tokens that are not such a flag come back for argparse's own error."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("--vllm-") or tok == "--vllm-":
            unknown.append(tok)
            i += 1
            continue
        name, eq, inline = tok[len("--vllm-") :].partition("=")
        values = [inline] if eq else []
        i += 1
        while not eq and i < len(rest) and not rest[i].startswith("--"):
            values.append(rest[i])
            i += 1
        out[name] = True if not values else values[0] if len(values) == 1 else values
    return out, unknown


def translate(values: dict[str, Any]) -> None:
    """Turn the foreign flags in `values["slime_flags"]` into vime settings, in place, where vime
    has one; a vime flag the user gave explicitly wins."""
    given = values.get("slime_flags") or {}
    granularity = given.get("recompute_granularity")
    if granularity == "full":
        values.setdefault("gradient_checkpointing", True)
        if given.get("recompute_method") == "block" and given.get("recompute_num_layers"):
            values.setdefault("gradient_checkpointing_layers", given["recompute_num_layers"])
    if given.get("use_dynamic_batch_size") and values.get("micro_batch_size") is not None:
        # slime reads --micro-batch-size only without --use-dynamic-batch-size
        given["_ignored_micro_batch_size"] = values.pop("micro_batch_size")


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


def notes(cfg: Any) -> list[str]:
    """The start-up lines: what vime does with each foreign flag given, each flag listed once."""
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


# ---- the model-shape check ------------------------------------------------------------


def model_facts(config: dict[str, Any], weight_names: set[str]) -> dict[str, Any]:
    """What each shape flag would have to say for this checkpoint, keyed by the flag's dest."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    rope = config.get("rope_theta")
    if rope is None:  # transformers 5 nests it
        rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_theta")
    act = config.get("hidden_act", "silu")

    def has(suffix: str) -> bool:
        return any(n.endswith(suffix) for n in weight_names)

    return {
        "num_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "ffn_hidden_size": config.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": kv_heads,
        "kv_channels": config.get("head_dim") or (config["hidden_size"] // heads if heads else None),
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "rotary_base": rope,
        "norm_epsilon": config.get("rms_norm_eps", config.get("layer_norm_eps")),
        "rotary_percent": config.get("partial_rotary_factor", 1.0),
        "normalization": "RMSNorm" if "rms_norm_eps" in config else "LayerNorm",
        "position_embedding_type": "rope" if rope is not None else None,
        "swiglu": act in ("silu", "swish") and has("mlp.gate_proj.weight"),
        "group_query_attention": bool(heads and kv_heads < heads),
        "qk_layernorm": has("self_attn.q_norm.weight"),
        "add_qkv_bias": has("self_attn.q_proj.bias"),
        "disable_bias_linear": not (has("self_attn.o_proj.bias") or has("mlp.down_proj.bias")),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "use_rotary_position_embeddings": rope is not None,
    }


def _same(flag_value: Any, fact: Any) -> bool:
    if isinstance(flag_value, float) and isinstance(fact, (int, float)):
        return math.isclose(
            flag_value, float(fact), rel_tol=1e-6
        )  # config.json may hold float32 roundings (9.99999975e-06)
    if isinstance(flag_value, str) and isinstance(fact, str):
        return flag_value.lower() == fact.lower()
    return flag_value == fact


def shape_contradictions(given: dict[str, Any], facts: dict[str, Any], source: str) -> str | None:
    """One line naming every shape flag that contradicts the checkpoint, or None.

    A value flag is compared when given. The switches are compared both ways once a model block
    is present (`--num-layers` or `--hidden-size` given): Megatron builds its model from the flags
    alone, so a switch left out (no --add-qkv-bias for a model with q/k/v biases) describes
    another model just as a wrong number does. Without --group-query-attention, Megatron ignores
    --num-query-groups (every head its own KV head)."""
    block = "num_layers" in given or "hidden_size" in given
    bad = []
    for name, fact in facts.items():
        f = FLAGS[name]
        if f.type is bool:
            if block and fact is not None and bool(given.get(name)) != fact:
                bad.append(
                    f"{f.flag} {'given' if given.get(name) else 'left out'} (checkpoint: {'yes' if fact else 'no'})"
                )
        elif name in given and fact is not None:
            if name == "num_query_groups" and block and not given.get("group_query_attention"):
                continue  # Megatron ignores it without --group-query-attention; the switch is compared above
            if not _same(given[name], fact):
                bad.append(f"{f.flag} {given[name]} (checkpoint: {fact})")
    if not bad:
        return None
    return (
        f"model flags contradict {source}: {'; '.join(bad)}. vime trains the checkpoint as it is: fix or drop "
        "these flags, or point --hf-checkpoint at the model they describe"
    )


def weight_names(model_dir: Path) -> set[str]:
    """Tensor names of an HF directory's safetensors, from the index or the files' headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


def parameter_count(model_dir: Path) -> int:
    """Elements in the checkpoint's tensors, read from the safetensors headers (no weights loaded)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


# float32 master weights (4) + gradients (4) + AdamW's two moments (8); a frozen float32 reference adds 4
TRAIN_BYTES_PER_PARAM, REF_BYTES_PER_PARAM = 16, 4


def fsdp_bytes_per_gpu(params: int, gpus: int, with_ref: bool) -> float:
    """The sharded training state one GPU holds under FSDP2, activations aside: a lower bound."""
    return params * (TRAIN_BYTES_PER_PARAM + REF_BYTES_PER_PARAM * with_ref) / gpus


def memory_refusal(params: int, gpus: int, with_ref: bool, gpu_bytes: int, sizes: str) -> str | None:
    """Megatron's sizes asked for a model split; FSDP2 over `gpus` GPUs holds 1/gpus of the
    state each. If even that does not fit one GPU, the script cannot be honoured here."""
    need = fsdp_bytes_per_gpu(params, gpus, with_ref)
    if need <= gpu_bytes:
        return None
    return (
        f"the model's training state takes {need / 2**30:.1f} GiB per GPU sharded by FSDP2 over {gpus} actor GPU(s) "
        f"({sizes or 'no model-parallel sizes'} asked for a split), more than the {gpu_bytes / 2**30:.1f} GiB a GPU has: "
        "add actor GPUs (--actor-num-gpus-per-node, --actor-num-nodes)"
    )


def check_model(cfg: Any, model_dir: Path, read_config: Callable[[Path], dict], gpu_bytes: int | None) -> list[str]:
    """Refusals about the checkpoint: shape contradictions, experts asked of a dense model, and a
    model whose sharded training state cannot fit the actor GPUs. `gpu_bytes`: one GPU's memory
    when the trainer runs on CUDA, else None."""
    g = cfg.slime_flags
    config = read_config(model_dir)
    out = []
    if any(FLAGS[n].kind == "shape" for n in g):
        line = shape_contradictions(
            {n: v for n, v in g.items() if n in FLAGS and FLAGS[n].kind == "shape"},
            model_facts(config, weight_names(model_dir)),
            str(model_dir / "config.json"),
        )
        if line:
            out.append(line)
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    for name in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        if g.get(name, 1) > 1 and not experts:
            out.append(f"{FLAGS[name].flag} {g[name]}: {model_dir} is a dense model, it has no experts to split; use 1")
    sizes = {n: g[n] for n in FLAGS if FLAGS[n].kind == "parallel" and g.get(n, 1) > 1}
    if gpu_bytes is not None:
        refusal = memory_refusal(
            parameter_count(model_dir),
            cfg.actor_num_nodes * cfg.actor_num_gpus_per_node,
            cfg.kl_loss_coef > 0,
            gpu_bytes,
            " ".join(f"{FLAGS[n].flag} {v}" for n, v in sizes.items()),
        )
        if refusal:
            out.append(refusal)
    return out
