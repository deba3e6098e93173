"""slime's own flags on vime (issue 68): SGLang's server arguments (`--sglang-*`) accepted and
mapped or named, every flag of slime's argument list answered, `--kl-coef` as slime computes it,
flags the run's mode leaves unread named at start-up, and the start-up line counting the trainer
ranks the run really has."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import run_cli

from unit.compat.slime_flag_names import MEGATRON_IN_SCRIPTS, SLIME_ARGUMENTS, SLIME_LATER
from vime import compat
from vime.backends.builtin.place import engine_args
from vime.compat import parse_args
from vime.config import ConfigError, build_parser
from vime.preflight import startup_notes

BASE = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--num-rollout", "1"]


def said(cfg) -> str:
    return "\n".join(startup_notes(cfg))


def line(cfg, start: str) -> str:
    """The start-up line that begins with `start` ('' when there is none)."""
    return next((x for x in startup_notes(cfg) if x.startswith(start)), "")


def test_sglang_flags_set_the_built_in_engines_settings_and_say_so():
    cfg = parse_args(
        [
            *BASE,
            "--sglang-mem-fraction-static", "0.7",
            "--sglang-max-running-requests", "32",
            "--sglang-context-length=4096",
            "--sglang-enable-deterministic-inference",
        ]
    )  # fmt: skip
    assert cfg.engine_kv_cache_memory_fraction == 0.7 and cfg.engine_max_num_seqs == 32
    assert cfg.rollout_max_context_len == 4096
    assert cfg.vllm_args == {}  # no vLLM server to pass them to
    mapped = line(cfg, "slime flags that set vime's: ")
    assert "--sglang-mem-fraction-static 0.7 → --engine-kv-cache-memory-fraction 0.7" in mapped
    assert "--sglang-context-length 4096 → --rollout-max-context-len 4096" in mapped
    assert "--sglang-enable-deterministic-inference (every sample's draws are fixed by --rollout-seed" in line(
        cfg, "slime/Megatron flags vime always follows: "
    )
    # the built-in engine is started with the fraction
    assert engine_args(cfg.placement, 0, 42)[-2:] == ["--kv-cache-memory-fraction", "0.7"]


def test_a_vime_flag_given_wins_over_the_sglang_one_and_the_line_says_so():
    cfg = parse_args([*BASE, "--sglang-max-running-requests", "32", "--engine-max-num-seqs", "16"])
    assert cfg.engine_max_num_seqs == 16
    assert "--sglang-max-running-requests 32 → --engine-max-num-seqs, which you gave as 16: yours holds" in said(cfg)


def test_with_vllm_sglang_flags_become_the_vllm_servers_arguments():
    cfg = parse_args(
        [
            *BASE, "--rollout-backend", "vllm",
            "--sglang-mem-fraction-static", "0.55",
            "--sglang-cuda-graph-bs", "1", "2", "4",
            "--sglang-cuda-graph-max-bs", "4",
            "--sglang-disable-radix-cache",
            "--sglang-context-length", "2048",
        ]
    )  # fmt: skip
    assert cfg.vllm_args == {
        "gpu-memory-utilization": 0.55,
        "cudagraph-capture-sizes": ["1", "2", "4"],
        "max-cudagraph-capture-size": 4,
        "no-enable-prefix-caching": True,
        "max-model-len": 2048,
    }
    assert cfg.engine_kv_cache_memory_fraction is None  # the built-in engine's: not set for vLLM
    assert "--sglang-cuda-graph-bs 1 2 4 → --vllm-cudagraph-capture-sizes 1 2 4" in said(cfg)


def test_every_sglang_flag_is_accepted_and_one_without_a_counterpart_is_named():
    """SGLang has hundreds of server arguments and slime takes them all: an unknown name is no
    refusal, and each is named once in the no-effect line with what vime does instead."""
    cfg = parse_args(
        [
            *BASE,
            "--sglang-ep-size", "8", "--sglang-enable-dp-attention", "--sglang-dp-size", "8",
            "--sglang-speculative-algorithm", "EAGLE", "--sglang-cuda-graph-bs", "1", "2", "4",
            "--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "30000",
            "--sglang-attention-backend", "flashinfer",
        ]
    )  # fmt: skip
    inert = line(cfg, "flags with no effect in vime: ")
    for flag in (
        "--sglang-ep-size 8 (an argument of the SGLang servers slime starts",
        "--sglang-enable-dp-attention (",
        "--sglang-dp-size 8 (vime spreads requests over its engines itself",
        "--sglang-speculative-algorithm EAGLE (",
        "--sglang-cuda-graph-bs 1 2 4 (the built-in engine captures decode graphs for every batch size",
        "--sglang-router-ip 10.0.0.1 (",
        "--sglang-router-port 30000 (",
        "--sglang-attention-backend flashinfer (the built-in engine runs its own attention kernels",
    ):
        assert inert.count(flag) == 1, flag
    assert cfg.slime_flags["sglang_router_port"] == "30000"  # kept as given


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--sglang-mem-fraction-static", "2"], "--sglang-mem-fraction-static 2: SGLang takes a share of the GPU's memory, in (0, 1]"),
        (["--sglang-max-running-requests", "many"], "--sglang-max-running-requests many: SGLang takes a whole number of at least 1"),
        (["--sglang-enable-metrics", "yes"], "--sglang-enable-metrics yes: SGLang takes no value (it is a switch)"),
        (["--engine-kv-cache-memory-fraction", "1.5"], "--engine-kv-cache-memory-fraction 1.5: a share of the free GPU memory, in (0, 1]"),
    ],
)  # fmt: skip
def test_a_value_sglang_would_not_take_is_one_line(argv, says):
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, *argv])
    assert str(e.value) == says


def test_sglang_flags_in_a_config_file_are_slimes_flags_too(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("sglang-mem-fraction-static: 0.6\nsglang_enable_metrics: true\n")
    cfg = parse_args([*BASE, "--config", str(yaml)])
    assert cfg.engine_kv_cache_memory_fraction == 0.6
    assert "--sglang-enable-metrics (the built-in engine always serves /metrics)" in said(cfg)


def test_every_flag_of_slimes_argument_list_is_vimes_or_answered():
    """No slime flag (nor a Megatron flag of slime's dense scripts) meets 'neither a vime nor a
    slime flag': each is vime's own, accepted with what vime does, or refused with what it is in
    slime and what vime has instead."""
    known = {o for a in build_parser(dialect=compat.SLIME)._actions for o in a.option_strings}
    unanswered = [
        name
        for name in [*SLIME_ARGUMENTS, *SLIME_LATER, *MEGATRON_IN_SCRIPTS]
        if f"--{name}" not in known and compat.absent(name.replace("-", "_")) is None
    ]
    assert not unanswered, unanswered


def test_refused_slime_flags_are_named_together_each_with_its_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(
            [*BASE, "--multi-latent-attention", "--q-lora-rank", "768", "--fp8-format", "e4m3", "--http-proxy", "x"]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert "(4 flags vime does not know)" in err[0]
    assert err[1].startswith(
        "  --multi-latent-attention (slime): a Megatron flag of a model architecture vime does not train"
    )
    assert err[3].startswith("  --fp8-format (slime): Transformer Engine's FP8 training; vime trains in bfloat16")
    assert err[4] == "  --http-proxy (slime): a proxy for slime's HTTP calls; not in vime yet"


def test_slimes_lora_script_flags_are_refused_together_each_with_vimes_counterpart(capsys):
    """scripts/run-qwen3-30B-A3B-lora.sh's LoRA block, and the loss flags of slime's DrGRPO and
    true_on_policy examples: each was 'neither a vime nor a slime flag'."""
    with pytest.raises(SystemExit):
        parse_args(
            [
                *BASE,
                "--use-lora", "--lora-target-preset", "moe_language_all", "--lora-rank", "32", "--lora-alpha", "64",
                "--save-lora", "/x/{rollout_id}", "--lora-weight-decay", "0.1", "--pg-loss-divisor", "40960",
                "--true-on-policy-mode",
            ]
        )  # fmt: skip
    err = capsys.readouterr().err
    assert "(6 flags vime does not know)" in err and "neither a vime nor a slime flag" not in err
    assert "  --use-lora (slime): slime's switch for LoRA; vime: --lora-rank N turns LoRA on" in err
    assert "  --lora-target-preset (slime): slime's named sets of LoRA targets; vime: --target-modules" in err
    assert (
        "  --pg-loss-divisor (slime): Dr.GRPO's constant divisor of the policy loss; vime: --calculate-per-token" in err
    )


def test_slimes_self_distillation_is_refused_saying_what_it_is(capsys):
    """run-qwen3-8B-opsd.sh: `--opd-type self` was argparse's bare invalid choice and its
    `--opsd-*` flags 'neither a vime nor a slime flag'."""
    opsd = ["--use-opd", "--opd-type", "self", "--opd-teacher-load", "/x"]
    with pytest.raises(SystemExit):
        parse_args([*BASE, *opsd, "--opsd-beta", "0.5", "--opsd-privileged-info-key", "solution"])
    err = capsys.readouterr().err
    assert "(2 flags vime does not know)" in err and "neither a vime nor a slime flag" not in err
    assert "  --opsd-beta (slime): slime's on-policy self-distillation (--opd-type self" in err
    with pytest.raises(ConfigError, match=r"^--opd-type self: slime's on-policy self-distillation .* not in vime yet"):
        parse_args([*BASE, *opsd])


def test_slimes_extra_log_flags_are_named_without_effect_not_refused():
    """--log-passrate and the like change only what slime logs; refusing them stopped scripts."""
    cfg = parse_args([*BASE, "--log-passrate", "--log-multi-turn", "--log-reward-category", "acc"])
    inert = line(cfg, "flags with no effect in vime: ")
    assert "--log-passrate (vime logs no pass@k" in inert and "--log-multi-turn (vime logs a multi-turn" in inert
    assert "--log-reward-category acc (vime logs a dict reward's other values" in inert


def test_slimes_straw_transport_and_session_flags_are_named_without_effect():
    cfg = parse_args(
        [
            *BASE,
            "--rollout-data-dir", "/shared/rollout", "--rollout-queue-online-gc", "--rollout-queue-lease-seconds",
            "120", "--rollout-io-concurrency", "8", "--rollout-session-id", "s", "--async-strategy", "mcore",
        ]
    )  # fmt: skip
    inert = line(cfg, "flags with no effect in vime: ")
    assert "--rollout-data-dir /shared/rollout (slime's straw rollout-data queue on a shared disk" in inert
    for flag in ("--rollout-queue-online-gc", "--rollout-queue-lease-seconds 120.0", "--rollout-io-concurrency 8"):
        assert flag in inert
    assert "--rollout-session-id s (vime's engines are the run's own" in inert
    assert "--async-strategy mcore (vime writes each checkpoint between two steps)" in inert


def test_kl_coef_is_what_slime_does_with_it():
    """slime subtracts --kl-coef × KL from each token's reward, which only REINFORCE++'s (and PPO's)
    returns read: 0 is vime's own behaviour, GRPO leaves it unread in slime too, REINFORCE++
    would train otherwise (refused), and beside --kl-loss-coef slime refuses it."""
    assert "--kl-coef 0 (no KL penalty in the reward)" in said(parse_args([*BASE, "--kl-coef", "0.00"]))
    inert = line(parse_args([*BASE, "--kl-coef", "0.05", "--advantage-estimator", "gspo"]), "flags with no effect")
    assert (
        "--kl-coef 0.05 (slime computes the KL with --advantage-estimator gspo too, and its returns leave it out"
        in inert
    )
    with pytest.raises(
        ConfigError, match=r"^--kl-coef 0\.05 with --advantage-estimator reinforce_plus_plus: slime subtracts"
    ):
        parse_args([*BASE, "--kl-coef", "0.05", "--advantage-estimator", "reinforce_plus_plus"])
    with pytest.raises(ConfigError, match=r"--kl-coef 0\.05 and --kl-loss-coef 0\.01: slime takes only one of them"):
        parse_args([*BASE, "--kl-coef", "0.05", "--kl-loss-coef", "0.01"])


def test_weight_sync_optimizer_and_determinism_flags_are_accepted_with_what_vime_does():
    cfg = parse_args(
        [
            *BASE,
            "--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/x",
            "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
            "--deterministic-mode", "--log-probs-chunk-size", "512",
        ]
    )  # fmt: skip
    assert cfg.weight_transport == "disk" and cfg.logprob_chunk_size == 512
    mapped, inert = line(cfg, "slime flags that set vime's: "), line(cfg, "flags with no effect in vime: ")
    assert "--update-weight-transport disk → --weight-transport disk" in mapped
    assert "--log-probs-chunk-size 512 → --logprob-chunk-size 512" in mapped
    assert "--update-weight-mode delta (slime's disk and delta weight sync: vime pushes the whole weights" in inert
    assert "--optimizer-cpu-offload (vime keeps AdamW's state in float32 on the actor GPUs" in inert
    assert "--deterministic-mode (vime does not switch torch to deterministic kernels" in inert
    cfg = parse_args([*BASE, "--update-weight-mode", "full", "--update-weight-transport", "nccl"])
    assert cfg.weight_transport == "auto"
    assert "--update-weight-mode full (the whole weights at every push)" in said(cfg)
    assert "--update-weight-transport nccl (vime picks the transport per engine" in said(cfg)


def test_flags_the_runs_mode_leaves_unread_are_named_at_start_up():
    cfg = parse_args(
        [*BASE, "--eval-prompt-data", "e.jsonl", "--n-samples-per-eval-prompt", "4", "--eval-top-p", "0.9"]
    )
    inert = line(cfg, "flags with no effect in vime: ")
    for flag in ("--eval-prompt-data e.jsonl", "--n-samples-per-eval-prompt 4", "--eval-top-p 0.9"):
        assert f"{flag} (no evaluation without --eval-interval)" in inert
    # the eval response length a run takes from --rollout-max-response-len is no flag it gave
    assert "--eval-max-response-len" not in said(parse_args([*BASE, "--rollout-max-response-len", "64"]))
    given = line(parse_args([*BASE, "--eval-max-response-len", "512"]), "flags with no effect in vime: ")
    assert "--eval-max-response-len 512 (no evaluation without --eval-interval)" in given
    evaluating = parse_args([*BASE, "--eval-prompt-data", "e.jsonl", "--eval-interval", "5", "--eval-top-p", "0.9"])
    assert "--eval-" not in line(evaluating, "flags with no effect in vime: ")
    sync = parse_args([*BASE, "--rollout-concurrency", "8"])
    assert "--rollout-concurrency 8 (only the fully-async worker keeps groups in flight; this run is sync)" in said(
        sync
    )
    vllm = parse_args([*BASE, "--rollout-backend", "vllm", "--engine-kv-cache-memory-fraction", "0.5"])
    assert "--engine-kv-cache-memory-fraction 0.5 (the built-in engine's; --rollout-backend vllm engines" in said(vllm)


def test_the_parallel_sizes_line_counts_the_ranks_the_run_has(monkeypatch):
    """On a CPU run of one process the line said the trainer 'shards over all 8 actor GPU(s)'."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sizes = ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "8", "--device", "cpu"]
    one = line(parse_args([*BASE, *sizes]), "Megatron's parallel sizes")
    assert "vime trains on one rank (cpu), the whole model there" in one and "8 actor GPU" not in one
    two = line(parse_args([*BASE, *sizes, "--actor-num-procs", "2"]), "Megatron's parallel sizes")
    assert "over its 2 CPU trainer process(es) with FSDP2" in two


def test_a_slime_script_with_sglang_flags_starts_and_trains(tmp_path):
    """slime's scripts pass --sglang-* flags (every one of them --sglang-mem-fraction-static):
    a real run with them on the tiny model trains and says what became of each."""
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path),
        "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-max-bs", "16", "--sglang-server-concurrency", "64",
        "--kl-coef", "0.00", "--optimizer-cpu-offload", "--tensor-model-parallel-size", "1",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"step 1/1", res.stderr)
    assert "--sglang-mem-fraction-static 0.7 → --engine-kv-cache-memory-fraction 0.7" in res.stderr
    assert "--sglang-server-concurrency 64 (vime sends a batch's requests at once" in res.stderr
    assert "vime trains on one rank (cpu)" in res.stderr


def test_the_seed_systems_fully_async_rollout_file_runs_as_the_rollout_function(tmp_path):
    """vllm-project/vime's examples/fully_async rollout file imports `generate_and_rm_group`,
    `vime.utils.async_utils.run`, reads `args.vllm_server_concurrency` and
    `args.rollout_global_dataset`, and returns the bare list of groups: a run with a rollout
    function of that shape trains two steps on groups its own thread generated and vime scored."""
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "2", "--runs-dir", str(tmp_path),
        "--rollout-function-path", "upstream_fully_async_style.generate_rollout_fully_async",
        "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step 2/2" in res.stderr
    for step in (0, 1):  # whole groups of 4, each sample generated and scored
        saved = torch.load(tmp_path / f"rollout_{step}.pt", weights_only=False)["samples"]
        assert len(saved) == 16 and all(isinstance(s["reward"], float) and s["response_length"] > 0 for s in saved)
