"""Per-request sampling parameters and the batched sampler.

The log-prob returned with each token is that of the distribution the token was actually drawn
from (after temperature and top-k/top-p renormalization), because that is the behaviour
policy an off-policy correction (TIS) must divide by. Greedy returns the raw log-softmax.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, fields

import torch

from vime.engine.core import kernels


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        """Validate a request's `sampling_params`; raises ValueError with a one-line message.

        Unknown keys are refused rather than ignored: silently dropping, say, a repetition
        penalty would return samples from a different distribution than the caller asked for.
        """
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unsupported sampling_params {unknown} (supported: {sorted(known)})")
        d = {k: v for k, v in d.items() if v is not None}
        try:
            p = cls(
                max_new_tokens=_int(d.get("max_new_tokens", cls.max_new_tokens), "max_new_tokens"),
                temperature=float(d.get("temperature", cls.temperature)),
                top_p=float(d.get("top_p", cls.top_p)),
                top_k=_int(d.get("top_k", cls.top_k), "top_k"),
                stop_token_ids=tuple(_int(t, "stop_token_ids") for t in d.get("stop_token_ids", ())),
                ignore_eos=bool(d.get("ignore_eos", False)),
                n=_int(d.get("n", 1), "n"),
            )
        except TypeError as e:
            raise ValueError(f"bad sampling_params: {e}") from None
        if p.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if p.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        if not 0 < p.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if p.n < 1:
            raise ValueError("n must be >= 1")
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


class Sampler:
    """Samples one token per row of logits with per-row parameters.

    Rows that only need temperature (or greedy) go through one Triton pass on GPU
    (`kernels.sample`); a batch where some row filters by top-k/top-p takes the PyTorch path
    (sort). Either way the result stays on the device: the caller brings tokens and log-probs
    back in one transfer.
    """

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernel_seeds = random.Random(seed)  # one Triton RNG seed per step, drawn on the host

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], temperatures: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] (any float dtype); temperatures: [B] float32 on the logits' device when
        the caller has them there already. Returns token ids (int64) and their log-probs (float32)."""
        device = logits.device
        filtered = any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params)
        if temperatures is None:
            temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device, non_blocking=True)
        if kernels.enabled(device) and not filtered:
            return kernels.sample(logits, temperatures, self.kernel_seeds.getrandbits(31))
        logits = logits.float()
        greedy = temperatures == 0
        scaled = logits / torch.where(greedy, 1.0, temperatures)[:, None]
        if filtered:
            scaled = self._top_k_top_p(scaled, params)
        logprobs = torch.log_softmax(scaled, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, batched, and rows with
        # p = 0 (filtered out) can never win.
        noise = torch.empty_like(logprobs).exponential_(generator=self.generator)
        sampled = (logprobs.exp() / noise).argmax(dim=-1)
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)

    @staticmethod
    def _top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = scaled.shape[-1]
        device = scaled.device
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params], device=device)
        top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device, dtype=scaled.dtype)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it
        # already does. The top token is always kept.
        # Rows without top-p are left alone: their cumulative sum may round past 1.0.
        drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
