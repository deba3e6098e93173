"""What the engine's tests check against: HF transformers' greedy tokens and teacher-forced
log-probs, a perturbed copy of the model to push, the prompts and tolerances, requests sent
concurrently, the engine's /metrics, and the torch sampler's reference draws."""

from __future__ import annotations

import asyncio
import copy
import urllib.error
import urllib.request

import torch

from vime.backends.client import EngineClient

ATOL = 1e-4
FP8_ATOL = 0.05  # an fp8 engine's log-probs against HF (tests/unit/engine/test_fp8.py says why)
PROMPTS = [[40], [50, 60, 70, 80, 90], list(range(10, 33)), [7, 8, 9] * 13]  # 1, 5, 23, 39 tokens


def generate_many(client: EngineClient, requests: list[dict]) -> list:
    """Send generate calls (kwargs of `EngineClient.generate`) concurrently; bodies in order."""

    async def main() -> list:
        try:
            return list(await asyncio.gather(*(client.generate(**r) for r in requests)))
        finally:
            await client.close()

    return asyncio.run(main())


def engine_metrics(url: str) -> dict[str, float]:
    """/metrics as {name without the vime_engine_ prefix: value}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {
        ln.split()[0].removeprefix("vime_engine_"): float(ln.split()[1])
        for ln in text.splitlines()
        if ln and not ln.startswith("#")
    }


def greedy(max_new_tokens: int, **kw) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **kw}


@torch.no_grad()
def hf_greedy(
    hf,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: tuple[int, ...] = (),
    repetition_penalty: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> list[int]:
    """Greedy decoding by full HF forwards (no cache): the reference when eos must be ignored.
    `repetition_penalty` as vLLM's: every token seen so far (prompt or output) has its logit
    divided by it when positive, multiplied when not. `presence` and `frequency` as OpenAI's
    penalties: a token's logit less frequency times its count in the output, and less presence
    if it is there at all."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = hf(torch.tensor([tokens])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(tokens)))
        logits[seen] = torch.where(
            logits[seen] > 0, logits[seen] / repetition_penalty, logits[seen] * repetition_penalty
        )
        counts = torch.bincount(torch.tensor(tokens[len(prompt) :], dtype=torch.long), minlength=logits.shape[0])
        logits -= frequency * counts + presence * (counts > 0)
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos_ids:
            break
    return tokens[len(prompt) :]


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], output: list[int], temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Teacher-forced log-probs of `output` under HF logits / temperature (renormalized top-k)."""
    logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def perturbed(hf, seed: int = 1, scale: float = 0.5):
    """A copy of the model with noisy weights: the 'trained' policy to push to the engine. The
    default noise makes a far sharper model than the tiny one (logits ~25x larger); fp8 checks
    take 0.02, a step of training's size, since fp8's error grows with the logits."""
    torch.manual_seed(seed)
    new = copy.deepcopy(hf)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn_like(p))
    return new


def check_sampler(sample, rows: int) -> None:
    """sample(logits, temperatures, seeds) draws from softmax(logits / T), returns that
    distribution's log-prob, and is a function of the row's seed alone."""
    logits = torch.tensor([0.0, -1.5, -3.0])
    seeds = torch.arange(rows, dtype=torch.int32) * 7919 + 11
    for t in (1.0, 0.5):
        tokens, lps = sample(logits.expand(rows, 3).contiguous(), torch.full((rows,), t), seeds)
        p = torch.softmax(logits / t, -1)
        assert (
            (torch.bincount(tokens, minlength=3) / rows - p).abs() <= 4 * (p * (1 - p) / rows).sqrt() + 1 / rows
        ).all()
        assert torch.allclose(lps, p.log()[tokens], atol=1e-5)
        again, _ = sample(logits.expand(rows, 3).flip(0).contiguous(), torch.full((rows,), t), seeds.flip(0))
        assert torch.equal(again.flip(0), tokens)  # same seed, same draw, whatever the row
    tokens, lps = sample(logits[None], torch.zeros(1), seeds[:1])  # temperature 0: argmax and the raw log-softmax
    assert tokens.tolist() == [0] and torch.allclose(lps, logits.log_softmax(-1)[:1], atol=1e-6)


def torch_sample(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor):
    """The PyTorch path of the sampler (top-k = vocab size forces it even where kernels run)."""
    from vime.engine.core.sampler import SamplingParams, sample

    params = [SamplingParams(temperature=float(t), top_k=logits.shape[-1] if t > 0 else -1) for t in temps]
    return sample(logits.float(), params, temps, seeds)
