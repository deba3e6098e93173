"""The engine process's flags (`python -m vime.engine.server`, `vime serve`): what `launch.py`
passes and a user of `vime serve` sets, checked here so a bad value is one usage line before
the model loads."""

from __future__ import annotations

import argparse
import math
import os

from vime.engine.http_common import API_KEY_ENV, is_loopback
from vime.engine.openai_api.routes import add_openai_flags

# a request body's default limit: room for a prompt of the whole context as JSON token ids (at
# most 8 bytes each) or as text, and never under 1 MiB (a push's CUDA handles, a long chat)
BODY_BYTES_PER_TOKEN = 16
MIN_BODY_BYTES = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vime.engine.server", description="the vime rollout engine (HTTP)")
    p.add_argument("--model-path", required=True, help="HF model directory (or 'smollm2' / 'tiny')")
    p.add_argument("--host", default="127.0.0.1", help="an address other than loopback needs --api-key")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"token every route but /health requires (Authorization: Bearer); default: ${API_KEY_ENV}, which keeps it out of the process list",
    )
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--num-kv-blocks", type=int, default=None, help="default: from --kv-cache-gb, or a share of free GPU memory"
    )
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.5,
        help="GPU: share of the memory free after loading weights",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (prompt + output); default: the model's max_position_embeddings",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly (debugging)")
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="book each step before launching the next (SGLang's name); by default the host books step N "
        "while the GPU computes step N+1 (debugging)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-for-file", metavar="PATH", help="size the KV cache from free memory once PATH exists")
    fp8 = "fp8: the projections run W8A8 (per-channel weight, per-token activation scales), requantized at each update"
    p.add_argument(
        "--quantization", choices=["fp8"], help=fp8 + "; embeddings and lm_head stay in --dtype (GPU: bf16, sm89+)"
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=None,
        help=f"largest request body in MiB, refused with 413 beyond (default: {BODY_BYTES_PER_TOKEN} bytes per token of the "
        f"longest sequence, at least {MIN_BODY_BYTES // 2**20} MiB: a prompt of the whole context fits)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: half the cores, the trainer needs the rest)",
    )
    add_openai_flags(p)
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (set by launch_engine)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    _refuse_out_of_range(p, args)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not args.api_key and not is_loopback(args.host):
        p.error(
            f"--host {args.host} would let anyone who reaches it change the weights: set --api-key (or ${API_KEY_ENV}), or bind 127.0.0.1"
        )
    return args


def _refuse_out_of_range(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each number of the command line in its range, as argparse's usage and one line (exit 2),
    before the model loads."""
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port}: give 0-65535 (0 picks a free port)")
    for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")  # usage, then one line; exit 2
    if args.max_request_mb is not None and not args.max_request_mb > 0:
        p.error(f"--max-request-mb {args.max_request_mb}: give a size in MiB above 0")
    # NaN and -1 ended the start in a traceback (sizing the cache), 0 was taken as "not given"
    for name in ("num_kv_blocks", "max_model_len", "num_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1 (leave it out for the default)")
    if args.kv_cache_gb is not None and not (math.isfinite(args.kv_cache_gb) and args.kv_cache_gb > 0):
        p.error(f"--kv-cache-gb {args.kv_cache_gb}: give a size in GB above 0")
    if not 0 < args.kv_cache_memory_fraction <= 1:  # NaN fails it too
        p.error(
            f"--kv-cache-memory-fraction {args.kv_cache_memory_fraction}: a share of the free GPU memory, in (0, 1]"
        )
