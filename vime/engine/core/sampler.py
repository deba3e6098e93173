"""Per-request sampling parameters and the batched sampler.

The log-prob returned with each token is that of the distribution the token was actually drawn
from (after temperature and top-k/top-p renormalization), because that is the behaviour
policy an off-policy correction (TIS) must divide by. Greedy returns the raw log-softmax.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, fields

import torch

from vime.engine.core import kernels

# SGLang's keys that shape only the text it detokenizes: `/generate` answers token ids, so they
# change nothing here and are taken (slime's OPD teacher request sends skip_special_tokens).
TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0  # vLLM's: a token less likely than min_p times the likeliest is dropped (0: off)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # strings that end a response, kept in it (stop.py)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None  # fixes the draws (SGLang's name); sample j of n gets its own stream
    # vLLM's: a token already in the prompt or response has its logit divided by this when positive,
    # multiplied when negative (1: off). vllm-project/vime's tau-bench agent samples at 1.1.
    repetition_penalty: float = 1.0
    # OpenAI's, as vLLM applies them: a token's logit less presence_penalty if the response so far
    # holds it, and less frequency_penalty times the number of times it does (the prompt's tokens
    # do not count); each in [-2, 2], 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # scheduling, not sampling: a waiting request of lower priority is admitted first (vLLM's
    # convention). Eval asks -1, so in an async run it does not queue behind the worker's backlog.
    priority: int = 0
    # OpenAI's: (token id, value added to its logit) pairs, each value in [-100, 100] (-100 bans it)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Validate a request's `sampling_params`; raises ValueError with a one-line message.

        Unknown keys are refused rather than ignored: silently dropping, say, a repetition
        penalty would return samples from a different distribution than the caller asked for.
        """
        d = {k: v for k, v in (d or {}).items() if k not in TEXT_ONLY}
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
                min_p=float(d.get("min_p", cls.min_p)),
                stop_token_ids=tuple(_int(t, "stop_token_ids") for t in d.get("stop_token_ids", ())),
                stop=_strings(d.get("stop", ()), "stop"),
                ignore_eos=bool(d.get("ignore_eos", False)),
                n=_int(d.get("n", 1), "n"),
                sampling_seed=_int(d["sampling_seed"], "sampling_seed") if "sampling_seed" in d else None,
                priority=_int(d.get("priority", 0), "priority"),
                repetition_penalty=float(d.get("repetition_penalty", 1.0)),
                presence_penalty=float(d.get("presence_penalty", 0.0)),
                frequency_penalty=float(d.get("frequency_penalty", 0.0)),
                logit_bias=_bias(d.get("logit_bias", {})),
            )
        except TypeError as e:
            raise ValueError(f"bad sampling_params: {e}") from None
        if p.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if not math.isfinite(p.temperature) or p.temperature < 0:  # NaN passes `< 0` and samples garbage
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= p.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {p.min_p}")
        if p.n < 1:
            raise ValueError("n must be >= 1")
        if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {p.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(p, name) <= 2:  # NaN fails too
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(p, name)}")
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _strings(v: object, name: str) -> tuple[str, ...]:
    """A string or a list of non-empty strings (an empty one would stop at once), as a tuple."""
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {v!r}")
    return tuple(v)


def _bias(v: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`, {token id (a JSON key, so text): value in [-100, 100]}, as pairs."""
    if not isinstance(v, dict):
        raise ValueError(f"logit_bias must be an object of token id to bias, got {v!r}")
    pairs = []
    for key, value in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias {key!r}: {value!r} must be a number in [-100, 100] for a token id >= 0")
        pairs.append((token, float(value)))
    return tuple(pairs)


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


M32 = 0xFFFFFFFF
_GOLDEN = 0x61C88647  # 2^32 / golden ratio, mod 2^32: spreads consecutive columns apart


def mix32(x):
    """A 32-bit integer hash (xor-shift-multiply rounds), the same function on Python ints,
    NumPy and torch int64 arrays, and inside the Triton sampler. The multipliers are below
    2^31, so with x < 2^32 every product fits in int64 and no language's overflow rules matter."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def step_seeds(seq_seeds, positions):
    """The RNG seed of each row of a step: a hash of the sequence's seed and the position of the
    token being drawn. So a sequence's draws depend on nothing else in the batch, and a request
    with `sampling_seed` gets the same tokens from the same logits however it was batched (or
    resumed after an abort)."""
    return mix32(seq_seeds ^ mix32(positions))


def uniform_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from per-row seeds: the PyTorch twin of the Triton sampler's
    noise (one hash per (row, column), the same bits kept, so the two paths draw the same tokens).

    The hash runs in place on one [B, V] int64 tensor: on CPU, a new tensor per operation made
    the noise a tenth of a float32 decode step (SmolLM2, 49k columns)."""
    x = (seeds.long()[:, None] & M32) + _column_offsets(vocab, seeds.device)[None, :]
    x &= M32
    return unit_interval(_mix32_(x))


@functools.lru_cache(maxsize=8)
def _column_offsets(vocab: int, device: torch.device) -> torch.Tensor:
    """column × the golden-ratio constant, the same every step: made once per vocabulary."""
    return torch.arange(vocab, device=device, dtype=torch.int64) * _GOLDEN


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` in place on an int64 tensor of 32-bit values (same constants, same result)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= M32
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x &= M32
    x ^= x >> 16
    return x


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes → float32 uniforms strictly inside (0, 1). 23 bits are kept: k + 0.5 with
    k < 2^23 is exact in float32, so the largest value is 1 - 2^-24, never 1.0 (with 24 bits,
    2^24 - 0.5 rounds up to 2^24, u would be 1.0, its Gumbel noise +inf, and ~V / 2^24 of all
    draws, about 1% at a 152k vocabulary, would pick that column whatever its probability)."""
    return (h >> 9).float().add_(0.5).mul_(2.0**-23)


def penalize_repeats(
    logits: torch.Tensor, rows: list[tuple[int, float, list[int]]], last: torch.Tensor | None
) -> torch.Tensor:
    """`logits` [B, V] with vLLM's repetition penalty applied: for each (row, penalty, seen ids) of
    `rows`, a seen token's logit is divided by the penalty when positive, multiplied when not.
    `last` [B], when given, holds each row's newest token on the device (a decode step's input,
    drawn by the step before and not yet on the host), which counts as seen too. One mask for the
    batch, its indices sent in one non-blocking copy each, so the step never waits for the GPU.
    Returns a new tensor: the caller's may be a CUDA graph's output buffer, and the log-probs the
    sampler returns are those of the penalized distribution, the one the token is drawn from."""
    device = logits.device

    def sent(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x

    logits = logits.float().clone()
    at = torch.tensor([i for i, _, _ in rows], dtype=torch.long)
    counts = torch.tensor([len(ids) for _, _, ids in rows], dtype=torch.long)
    cols = torch.tensor(list(itertools.chain.from_iterable(ids for _, _, ids in rows)), dtype=torch.long)
    penalty = torch.ones(logits.shape[0], dtype=torch.float32)
    penalty[at] = torch.tensor([p for _, p, _ in rows], dtype=torch.float32)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[sent(torch.repeat_interleave(at, counts)), sent(cols)] = True
    if last is not None:
        on = sent(at)
        seen[on, last[on].long()] = True
    p = sent(penalty)[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def penalize_occurrences(
    logits: torch.Tensor, rows: list[tuple[int, float, float, list[int], bool]], last: torch.Tensor | None
) -> torch.Tensor:
    """`logits` [B, V] with OpenAI's presence and frequency penalties, as vLLM applies them: for
    each (row, presence, frequency, response ids so far, pending) of `rows`, a token's logit less
    frequency times its count in the response and presence if the count is not 0. `pending`: the
    row's newest token is not in its ids yet but in `last` [B] on the device (a decode step's input,
    as for `penalize_repeats`), and counts once. A new tensor, its log-probs those of the penalized
    distribution (the caller's may be a CUDA graph's output buffer)."""
    device = logits.device

    def sent(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x

    logits = logits.float().clone()
    at = torch.tensor([r[0] for r in rows], dtype=torch.long)
    lens = torch.tensor([len(r[3]) for r in rows], dtype=torch.long)
    cols = torch.tensor(list(itertools.chain.from_iterable(r[3] for r in rows)), dtype=torch.long)
    counts = torch.zeros_like(logits)
    one = torch.ones((), device=device)
    counts.index_put_((sent(torch.repeat_interleave(at, lens)), sent(cols)), one, accumulate=True)
    waiting = torch.tensor([r[0] for r in rows if r[4]], dtype=torch.long)
    if last is not None and len(waiting):
        on = sent(waiting)
        counts.index_put_((on, last[on].long()), one, accumulate=True)
    presence = torch.zeros(logits.shape[0], dtype=torch.float32)
    frequency = torch.zeros(logits.shape[0], dtype=torch.float32)
    presence[at] = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    frequency[at] = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    return logits - sent(frequency)[:, None] * counts - sent(presence)[:, None] * (counts > 0)


def add_logit_bias(logits: torch.Tensor, rows: list[tuple[int, tuple[tuple[int, float], ...]]]) -> torch.Tensor:
    """`logits` [B, V] with each (row, its `logit_bias` pairs) of `rows` added, as OpenAI's
    `logit_bias`: the token is then drawn from the biased distribution and its log-prob is that
    one's, as for the repetition penalty. A new tensor: the caller's may be a CUDA graph's output."""
    at = [i for i, pairs in rows for _ in pairs]
    cols = [t for _, pairs in rows for t, _ in pairs]
    bias = torch.tensor([b for _, pairs in rows for _, b in pairs], dtype=torch.float32)
    index = torch.tensor([at, cols], dtype=torch.long)
    if logits.device.type == "cuda":
        index, bias = (
            index.pin_memory().to(logits.device, non_blocking=True),
            bias.pin_memory().to(logits.device, non_blocking=True),
        )
    return logits.float().index_put((index[0], index[1]), bias, accumulate=True)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], temperatures: torch.Tensor, seeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [B, V] with per-row parameters; temperatures [B] float32 and
    seeds [B] (int32 bits of `step_seeds`) on the logits' device. Returns token ids (int64) and
    their log-probs (float32), still on the device: the caller brings them back in one copy.

    Rows that only need temperature (or greedy) go through one Triton pass on GPU
    (`kernels.sample`); a batch where some row filters by top-k/top-p takes the PyTorch path
    (sort; min-p too). Both draw by Gumbel-max with the same noise, so a row's token does not depend on
    which path its batch took.
    """
    filtered = any(not p.greedy and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in params)
    if kernels.enabled(logits.device) and not filtered:
        return kernels.sample(logits, temperatures, seeds)
    logits = logits.float()
    greedy = temperatures == 0
    scaled = logits * (1.0 / torch.where(greedy, 1.0, temperatures))[:, None]  # as the kernel: times 1/T
    if filtered:
        scaled = _top_k_top_p(scaled, params)
    logprobs = torch.log_softmax(scaled, dim=-1)
    # Gumbel-max: argmax(x + G) with G = -log(-log U) draws from softmax(x); filtered-out
    # tokens (-inf) can never win.
    # (in place: log(-log U) = -G, and scaled - (-G) is exactly scaled + G)
    minus_gumbel = uniform_noise(seeds, logits.shape[-1]).log_().neg_().log_()
    sampled = (scaled - minus_gumbel).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`scaled` (logits / T) with the tokens each row's min-p, top-k and top-p drop at -inf;
    min-p first, on the whole distribution, as vLLM's sampler does."""
    vocab = scaled.shape[-1]
    device = scaled.device
    if any(p.min_p > 0 and not p.greedy for p in params):  # asked on the host: no device sync
        min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=device, dtype=scaled.dtype)
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
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
