"""Trainer throughput: eager HF padded full-logit baseline vs vime's packed, chunked trainer.

Same model (Qwen3-0.6B shape, or `--shape qwen3-4b`, or the mixture of experts `--shape qwen3-30b-a3b-4l`; random weights), same GRPO-shaped batch (prompts 100–500 tokens,
responses 100–2000, seeded), same token budget per micro-batch, in one run:

* `hf_padded`: HF model in bf16, right-padded micro-batches (longest first, batch × longest
  length ≤ budget), full-vocabulary float logits, log-softmax, gather; fused AdamW.
* `vime`: `launch_actor` (FSDP2 on one rank: bf16 compute, float32 master weights and AdamW
  state), packed micro-batches with varlen attention, chunked log-probs.

Both are timed on forward + backward + optimizer step of a policy-gradient loss (old log-probs
given), so tokens/s compare like for like; `vime train_step` also times the full step (one
optimizer step per rollout, so the old log-probs come from the training forward, no recompute). MFU counts the FLOPs the step needs (vime.trainer.perf: decoder on all
tokens, LM head on response tokens, causal attention per sequence) over the 989 TFLOP/s dense
bf16 peak of an H200, for both rows. Prints a markdown table last.

    PYTHONPATH=. python3 bench/bench_trainer.py --device cuda
    PYTHONPATH=. python3 bench/bench_trainer.py --gpus 1,2 --no-compile --no-hf   # FSDP2 on 1 and 2 GPUs
    PYTHONPATH=. python3 bench/bench_trainer.py --shape qwen3-4b --max-tokens-per-gpu 8192 --hf-max-tokens-per-gpu 4096
    PYTHONPATH=. python3 bench/bench_trainer.py --shape qwen3-4b --max-tokens-per-gpu 8192 --no-hf --no-eager --warm-up-steps 2
    PYTHONPATH=. python3 bench/bench_trainer.py --shape qwen3-30b-a3b-4l   # Qwen3-30B-A3B cut to 4 layers (MoE)
    PYTHONPATH=. python3 bench/bench_trainer.py --device cpu --tiny     # smoke test (add --shape for its family)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.shapes import add_shape_args, hf_config, pick
from vime.config import Config
from vime.rollout.types import Sample
from vime.trainer.packing import packed_attention_backend
from vime.trainer.perf import PEAK_BF16_FLOPS, mfu, train_flops

RECORDED = Path(__file__).resolve().parent / "data" / "trainer_recorded.json"


def make_model(out: Path, shape: dict, device: str = "cpu") -> Path:
    """Random weights written as an HF directory; built on `device` in bf16 on a GPU (a 4B model's
    float32 init on the slow host CPU takes minutes), float32 on CPU."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = hf_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    model.save_pretrained(out)
    del model
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)
    return out


def make_batch(
    n: int, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int
) -> tuple[list[Sample], list[float]]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        p, r = rng.randint(*prompt), rng.randint(*response)
        samples.append(Sample(index=i, tokens=[rng.randrange(2, vocab) for _ in range(p + r)], response_length=r))
    return samples, [rng.choice([-1.0, 1.0]) * rng.random() for _ in range(n)]


def timed(fn: Callable[[], Any], device: torch.device, steps: int, warm_up: int = 1) -> tuple[float, float]:
    """(median seconds per call after `warm_up` calls, peak GiB allocated)."""
    for _ in range(warm_up):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device.type != "cuda":
        return statistics.median(times), float("nan")
    # a full cache makes the allocator free every cached block and call cudaMalloc again, a sync
    # each time: near the memory's limit (the 4B shape) that, not the kernels, can set the step
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    if retries:
        print(f"  the allocator flushed its cache {retries} times in {steps} timed steps", flush=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def hf_padded_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    samples: list[Sample],
    adv: list[float],
    old: list[torch.Tensor],
    budget: int,
    device: torch.device,
) -> None:
    """The eager baseline: padded micro-batches, full logits, token-mean PPO-style loss."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(samples[batches[-1][0]].tokens) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    n_tokens = sum(s.response_length for s in samples)
    for idx in batches:
        width = max(len(samples[i].tokens) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, : len(samples[i].tokens)] = torch.tensor(samples[i].tokens)
            mask[b, : len(samples[i].tokens)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        log_p = torch.log_softmax(logits, -1)
        loss = logits.new_zeros(())
        for b, i in enumerate(idx):
            s = samples[i]
            pos = torch.arange(s.prompt_length - 1, len(s.tokens) - 1, device=device)
            lp = log_p[b, pos, torch.tensor(s.response_tokens, device=device)]
            loss = loss - (torch.exp(lp - old[i]) * adv[i]).sum() / n_tokens
        del logits, log_p
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def pct(m: float) -> str:
    """MFU as a percentage; none on CPU, which has no bf16 peak to measure against."""
    return "n/a" if m != m else f"{m:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, moe=True)
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="vime recomputes activations in the backward (MFU still counts only the FLOPs the step needs)",
    )
    ap.add_argument("--samples", type=int, default=None, help="sequences per step (default 64; 8 with --tiny)")
    ap.add_argument(
        "--max-tokens-per-gpu", type=int, default=None, help="micro-batch token budget (default 16384; 512 with --tiny)"
    )
    ap.add_argument(
        "--hf-max-tokens-per-gpu",
        type=int,
        default=None,
        help="the HF baseline's micro-batch budget (default: --max-tokens-per-gpu); its full logits "
        "outgrow an H200 past 16384",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after --warm-up-steps)")
    ap.add_argument(
        "--warm-up-steps",
        type=int,
        default=1,
        help="untimed steps before them: at the 4B shape the steps after compile were still speeding up "
        "(bench/RESULTS.md), so use 2 there; the recorded figures used 1",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gpus",
        default="1",
        help="comma-separated trainer GPU counts (FSDP2 ranks over NCCL); more than 1 times train_step only",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variant")
    ap.add_argument(
        "--no-eager",
        action="store_true",
        help="skip the eager variant (with it, the compiled rows lack their log-prob check)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HF eager baseline")
    ap.add_argument(
        "--attention-kernel",
        default="auto",
        choices=("auto", "fa4", "fa2", "sdpa"),
        help="the trainer's --attention-kernel (auto: FlashAttention-4 where installed and passing its check, else FlashAttention-2; fa4 needs flash-attn-4, bench/fa4_prep.sh)",
    )
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also each vime variant with LoRA of this rank on every linear layer (alpha = 2 × rank), beside the full one",
    )
    a = ap.parse_args()
    device = torch.device(a.device)
    shape = pick(a.shape, a.tiny)
    n = a.samples or (8 if a.tiny else 64)
    budget = a.max_tokens_per_gpu or (512 if a.tiny else 16384)
    prompt, response = ((10, 50), (10, 200)) if a.tiny else ((100, 500), (100, 2000))
    samples, adv = make_batch(n, shape["vocab_size"], prompt, response, a.seed)
    lengths = [len(s.tokens) for s in samples]
    tokens = sum(lengths)
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
        f"{n} sequences, {tokens} tokens ({sum(s.response_length for s in samples)} response), budget {budget}",
        flush=True,
    )

    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.trainer.distributed import launch_actor

    tmp = Path(tempfile.mkdtemp(prefix="vime-bench-"))
    model_dir = make_model(tmp / "model", shape, a.device)
    config = AutoConfig.from_pretrained(model_dir)
    step_flops = train_flops(config, lengths, [s.response_length for s in samples], forwards=0)
    lora_flops = train_flops(config, lengths, [s.response_length for s in samples], forwards=0, frozen=True)
    rows: list[tuple[str, float, float, float]] = []

    def record(name: str, seconds: float, peak: float, flops: float, gpus: int = 1) -> None:
        m = mfu(flops, seconds, gpus) if device.type == "cuda" else float("nan")
        rows.append((name, tokens / seconds, m, peak))
        print(
            f"{name}: {seconds * 1e3:.0f} ms/step, {tokens / seconds:,.0f} tok/s, MFU {pct(m)}, peak {peak:.1f} GiB",
            flush=True,
        )

    # ---- vime first: its log-probs are the old log-probs of both loss computations ----
    old = [torch.full((s.response_length,), -1.0) for s in samples]  # replaced by vime's log-probs when it runs
    variants = [
        (g, c, r)
        for g in (int(x) for x in a.gpus.split(","))
        for c in ((False,) if a.no_compile else (True,) if a.no_eager else (False, True))
        for r in ((0, a.lora_rank) if a.lora_rank else (0,))
    ]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the packed attention ran in
    kernels: set[str] = set()
    for gpus, compiled, rank in variants:
        tag = (
            (f", LoRA r{rank}" if rank else "")
            + (" + compile" if compiled else "")
            + (f", {gpus} GPUs (FSDP2)" if gpus > 1 else "")
        )
        flops = lora_flops if rank else step_flops
        try:
            args = Config(
                lr=1e-6,
                clip_grad=1.0,
                max_tokens_per_gpu=budget,
                global_batch_size=n,
                rollout_temperature=1.0,
                seed=a.seed,
                actor_num_nodes=1,
                actor_num_gpus_per_node=gpus,
                gradient_checkpointing=a.gradient_checkpointing,
                compile=compiled,
                lora_rank=rank,
                lora_alpha=2.0 * rank,
                attention_kernel=a.attention_kernel,
            )
            t0 = time.perf_counter()
            actor = launch_actor(args, model_dir, a.device)
            local = getattr(actor, "local", actor)
            if gpus == 1:  # settled on the model at its load (a multi-GPU group's model is in its ranks)
                kernels.add(packed_attention_backend(local.model, device, dtype))
            log_probs = [o.cpu() for o in actor.compute_log_probs(samples)]
            # compiled: compute_log_probs waited for the compile of every micro-batch size; LoRA: B
            # starts at zero, so the model is the base model
            if a.no_eager and gpus == 1 and not rank:  # no eager log-probs to check against
                old = log_probs
                print(
                    f"vime{tag}: trainer built in {time.perf_counter() - t0:.1f} s; attention "
                    f"{packed_attention_backend(local.model, device, dtype)}",
                    flush=True,
                )
            elif compiled or rank:
                diff = max(float((x - y).abs().max()) for x, y in zip(log_probs, old))
                print(
                    f"vime{tag}: trainer built in {time.perf_counter() - t0:.1f} s; max |log-prob difference| vs eager {diff:.2e}",
                    flush=True,
                )
            elif gpus == 1:
                old = log_probs
                print(
                    f"vime attention backend: {packed_attention_backend(local.model, device, dtype)}",
                    flush=True,
                )

            def vime_fwd_bwd_opt(local=local, old=old) -> None:  # train_step's optimizer step alone
                local.optimizer_step.run(samples, torch.tensor(adv), old, None)

            if gpus == 1:  # rank 0's Actor alone: only train_step drives every rank
                record(
                    f"vime packed+chunked{tag} (fwd+bwd+opt)",
                    *timed(vime_fwd_bwd_opt, device, a.steps, a.warm_up_steps),
                    flops,
                )
            record(
                f"vime train_step{tag}",
                *timed(lambda actor=actor: actor.train_step(samples, adv), device, a.steps, a.warm_up_steps),
                flops,
                gpus,
            )
            actor.close()
            # free the model before the next variant: the step function holds it as a default
            actor = local = vime_fwd_bwd_opt = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception:  # keep the other rows even if this path breaks on some build
            traceback.print_exc()

    if a.no_hf:
        print_table(rows)
        print_against_recorded(rows, a, budget, device, kernels)
        return
    # ---- eager HF baseline ----
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    old_dev = [o.to(device) for o in old]
    with torch.no_grad():  # the two paths score the same tokens alike (bf16 noise on GPU)
        model.eval()
        ref = [
            torch.log_softmax(model(torch.tensor([s.tokens], device=device)).logits[0].float(), -1)[
                torch.arange(s.prompt_length - 1, len(s.tokens) - 1, device=device),
                torch.tensor(s.response_tokens, device=device),
            ]
            for s in samples[:4]
        ]
        model.train()
    diff = max(float((r - c.to(device)).abs().max()) for r, c in zip(ref, old[:4]))
    print(f"max |log-prob difference| vime vs HF on 4 sequences (before training): {diff:.2e}", flush=True)
    hf_budget = a.hf_max_tokens_per_gpu or budget
    try:
        record(
            "HF eager padded, full logits" + (f" (budget {hf_budget})" if hf_budget != budget else ""),
            *timed(
                lambda: hf_padded_step(model, opt, samples, adv, old_dev, hf_budget, device),
                device,
                a.steps,
                a.warm_up_steps,
            ),
            step_flops,
        )
    except torch.OutOfMemoryError:
        print("HF eager padded: out of memory", flush=True)

    print_table(rows)
    print_against_recorded(rows, a, budget, device, kernels)


def print_table(rows: list[tuple[str, float, float, float]]) -> None:
    """MFU is over every GPU the variant uses; peak memory is rank 0's."""
    print(
        f"\n| variant | tokens/s | MFU (of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s per GPU) | peak memory GiB (rank 0) |\n|---|---|---|---|"
    )
    for name, tps, m, peak in rows:
        print(f"| {name} | {tps:,.0f} | {pct(m)} | {peak:.1f} |")


def print_against_recorded(
    rows: list[tuple[str, float, float, float]],
    a: argparse.Namespace,
    budget: int,
    device: torch.device,
    kernels: set[str],
) -> None:
    """Each variant beside the last figure recorded for this shape, batch, budget and attention
    kernel (`kernels`: what the one-GPU variants' models ran) on an H200
    (bench/data/trainer_recorded.json), so a fall shows on the day it happens: a 10% loss went
    unnoticed for two days once (issue 50). A change larger than the recorded spread of two runs
    *and* 3% (one H200 measured ~10% faster than another with the same code) is flagged; the next
    step for a flagged fall is bench/trainer_trees.py, the old tree against this one in one call."""
    if device.type != "cuda" or a.tiny or a.lora_rank or a.gradient_checkpointing or a.samples or a.seed:
        return  # recorded only for the default batch on a GPU
    if len(kernels) != 1:
        return  # no one-GPU variant ran, or they ran different kernels: no one figure to compare with
    kernel = kernels.pop()  # what the variants ran (settled on each model at its load)
    recorded = json.loads(RECORDED.read_text()).get(f"{a.shape}@{budget}/{kernel}", {})
    if not recorded:
        return
    print(f"\nagainst the recorded figures ({RECORDED.relative_to(RECORDED.parents[2])}):")
    for name, tps, _, _ in rows:
        ref = recorded.get("variants", {}).get(name)
        if ref is None:
            continue
        change = tps / ref["tok_s"] - 1
        margin = max(ref["spread"] / ref["tok_s"], 0.03)
        verdict = "FELL beyond the spread" if change < -margin else "rose" if change > margin else "within the spread"
        print(
            f"  {name}: {tps:,.0f} tok/s against {ref['tok_s']:,.0f} ({recorded['date']}, {recorded['commit']}): "
            f"{change:+.1%}, {verdict} (±{margin:.1%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
