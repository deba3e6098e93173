"""Plug-ins of the runs against real vLLM servers (`--rollout-backend vllm`), loaded by dotted
path: a generate that probes the engine after each sample, so a test sees every push in what the
server computes, and one that kills an engine's server mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

from vime.rollout.types import Sample

PROBE = list(range(10, 45))  # 35 tokens: two full KV blocks of 16, so the prefix cache holds them


async def recording_generate(args, sample: Sample, params: dict) -> Sample:
    """Plug-in generate for the runs of test_vllm_runs.py: the default one, then a one-token greedy probe on a
    fixed prompt, recorded with its weight version in $VIME_TEST_RECORD, so the test can see
    the engine's output move with every push."""
    from vime.rollout.generate import generate

    sample = await generate(args, sample, params)
    probe = await args.runtime.clients[0].generate(PROBE, {"max_new_tokens": 1, "temperature": 0.0})
    row = {
        "versions": sample.weight_versions,
        "probe_version": probe["meta_info"]["output_weight_versions"][0],
        "probe_logprob": probe["meta_info"]["output_token_logprobs"][0],
    }
    with open(os.environ["VIME_TEST_RECORD"], "a") as f:
        f.write(json.dumps(row) + "\n")
    return sample


def servers_on(port: str) -> list[int]:
    """The pids of the vLLM server processes listening on `port`."""
    out = subprocess.run(
        ["pgrep", "-f", f"vllm.entrypoints.openai.api_server.*--port {port}"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


async def kill_engine_one(args, sample: Sample, params: dict) -> Sample:
    """Plug-in generate for the two-engine run: the default one, except that in step 2 engine 1's
    server is killed (SIGKILL to its process group) while requests are in flight, and step 3
    waits until it is back, so the push after step 3 re-syncs it and steps 4-5 use it again.
    Each engine's --max-model-len is recorded in steps 1 and 5 (the --vllm-* pass-through)."""
    runtime = args.runtime
    step = sample.index // (args.rollout_batch_size * args.n_samples_per_prompt) + 1
    marker = args.run_dir / "engine1-killed"
    if step == 2 and not marker.exists():
        marker.write_text("killed")
        port = runtime.engines[1].client.url.rsplit(":", 1)[1]
        os.killpg(os.getpgid(servers_on(port)[0]), signal.SIGKILL)
    if step == 3:
        deadline = time.monotonic() + 400
        while runtime.engines[1].state != "unsynced":
            assert time.monotonic() < deadline, "engine 1 did not come back"
            await asyncio.sleep(0.5)
    if step in (1, 5) and sample.index % args.n_samples_per_prompt == 0:
        lens = [(await asyncio.to_thread(e.client.model_info))["max_seq_len"] for e in runtime.engines]
        with open(args.run_dir / "max_model_len.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "lens": lens}) + "\n")
    from vime.rollout.generate import generate

    return await generate(args, sample, params)
