"""The trainer's benches run their CPU smoke settings end to end: they import the trainer's
internals by name (`profile_trainer.py` wraps `pack`, `to_device` and the optimizer step), so a
restructure that moves one breaks them silently until the next GPU session finds out; this is
where it shows instead. Their figures are GPU claims (bench/RESULTS.md), not checked here. In
this process: the scripts are modules of the `bench` package, and importing torch again in a
subprocess would cost more than the runs."""

from __future__ import annotations

import re
import sys

import pytest


def run_bench(module: str, argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    main = __import__(f"bench.{module}", fromlist=["main"]).main
    monkeypatch.setattr(sys, "argv", [f"bench/{module}.py", *argv])
    main()
    return capsys.readouterr().out


def rows(out: str) -> dict[str, float]:
    """The summary table's tokens/s by variant."""
    return {m[1]: float(m[2].replace(",", "")) for m in re.finditer(r"^\| ([^|]+?) \| ([\d,]+) \|", out, re.M)}


def test_profile_trainer_runs_and_traces_its_step(capsys, monkeypatch):
    argv = ["--device", "cpu", "--tiny", "--variants", "eager", "--steps", "1"]
    out = run_bench("profile_trainer", argv, capsys, monkeypatch)
    assert "eager: traced step" in out and "| idle (no kernel running) |" in out
    assert rows(out).get("eager", 0) > 0, out[-2000:]


def test_bench_trainer_runs_its_variants(capsys, monkeypatch):
    argv = ["--device", "cpu", "--tiny", "--no-hf", "--no-compile", "--steps", "1"]
    got = rows(run_bench("bench_trainer", argv, capsys, monkeypatch))
    assert got.get("vime train_step", 0) > 0 and got.get("vime packed+chunked (fwd+bwd+opt)", 0) > 0, got


def test_bench_trainer_runs_a_mixture_of_experts_shape(capsys, monkeypatch):
    """--shape qwen3-30b-a3b-4l with --tiny: the 2-layer Qwen3-MoE stand-in, against HF (issue 70's
    trainer measurement)."""
    argv = ["--device", "cpu", "--tiny", "--shape", "qwen3-30b-a3b-4l", "--no-compile", "--steps", "1"]
    out = run_bench("bench_trainer", argv, capsys, monkeypatch)
    got = rows(out)
    assert got.get("vime train_step", 0) > 0 and got.get("HF eager padded, full logits", 0) > 0, got
    difference = float(re.search(r"vime vs HF on \d+ sequences \(before training\): ([\d.e+-]+)", out)[1])
    assert difference < 1e-4, out[-2000:]


def test_profile_trainer_times_two_variants_untraced(capsys, monkeypatch):
    """`--no-trace` and `/scoredold` (the old log-probs the model's own, as bench_trainer.py's):
    both variants time their steps in one process, the first one's Actor freed before the second."""
    argv = ["--device", "cpu", "--tiny", "--variants", "eager,eager/scoredold", "--steps", "1", "--no-trace"]
    out = run_bench("profile_trainer", argv, capsys, monkeypatch)
    assert "eager/scoredold: untraced median step" in out and ": traced step" not in out
    got = rows(out)
    assert got.get("eager", 0) > 0 and got.get("eager/scoredold", 0) > 0, out[-2000:]


def test_profile_trainer_refuses_a_variant_flag_it_does_not_know(capsys, monkeypatch):
    """A misspelt or retired flag (`/vecaccum`, now the trainer's default) stops the bench in one
    line before any model is built, rather than timing the default under the flag's name."""
    argv = ["--device", "cpu", "--tiny", "--variants", "eager,compile/vecaccum"]
    with pytest.raises(SystemExit) as exc:
        run_bench("profile_trainer", argv, capsys, monkeypatch)
    assert exc.value.code == 2
    assert "'compile/vecaccum' is not eager or compile" in capsys.readouterr().err


def test_runs_sharing_a_gpu_get_a_fixed_kv_cache_unless_their_flags_say_otherwise():
    """Engines left to size their KV cache take half the GPU memory free at their start, so runs
    started together on one GPU (real_ab.py's and staleness_study.py's --parallel) starve the
    later ones' trainers: each run's flags fix the count, unless they set it or run vLLM (which
    refuses the flag)."""
    from bench.real_ab import SHARED_GPU_KV_BLOCKS, kv_cache_flags

    fixed = ["--engine-num-kv-blocks", str(SHARED_GPU_KV_BLOCKS)]
    assert kv_cache_flags(True, 4, ["--seed", "1", "--eps-clip", "0.1"]) == fixed
    assert kv_cache_flags(True, 4, ["--rollout-backend", "vime"]) == fixed
    assert kv_cache_flags(True, 1, []) == [] and kv_cache_flags(False, 4, []) == []
    assert kv_cache_flags(True, 4, ["--engine-num-kv-blocks", "100"]) == []
    assert kv_cache_flags(True, 4, ["--engine-num-kv-blocks=100"]) == []
    assert kv_cache_flags(True, 4, ["--rollout-backend", "vllm"]) == []
    assert kv_cache_flags(True, 4, ["--rollout-backend=vllm"]) == []


def test_profile_trainer_goes_on_past_a_variant_out_of_memory(capsys, monkeypatch):
    """A micro-batch budget too large for the GPU fails its variant alone: the call says so and
    times the others, so one call can try a budget that may not fit. So does a variant whose
    attention kernel cannot run here (/fa4 on CPU)."""
    import torch

    from bench import profile_trainer

    real = profile_trainer.step_fn

    def step_fn(local, *args):
        if local.args.max_tokens_per_gpu == 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(local, *args)

    monkeypatch.setattr(profile_trainer, "step_fn", step_fn)
    argv = [
        "--device",
        "cpu",
        "--tiny",
        "--variants",
        "eager:256,eager:512/fa4,eager:512",
        "--steps",
        "1",
        "--no-trace",
    ]
    out = run_bench("profile_trainer", argv, capsys, monkeypatch)
    assert "eager:256: out of GPU memory at nan GiB (CUDA out of memory. Tried to allocate 9.00 GiB)" in out
    assert "eager:512/fa4: --attention-kernel fa4 runs on CUDA only" in out and "| eager:512/fa4 | nan |" in out
    assert "| eager:256 | nan |" in out and rows(out).get("eager:512", 0) > 0, out[-2000:]
