"""The built-in engine's parts without a server, with HF transformers as the reference: the model
code of other architectures, the scheduler (preemption, priorities, an eval taking a rollout's
seat), stop strings read from a tail of the text, the torch sampler, and a server bound beyond
loopback without a key refused."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from unit.engine.reference import (
    ATOL,
    PROMPTS,
    check_sampler,
    engine_metrics,
    generate_many,
    greedy,
    hf_greedy,
    hf_logprobs,
    torch_sample,
)
from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_code_matches_hf_other_archs(tmp_path, arch):
    """Llama (tied embeddings, sharded checkpoint) and Qwen2 (q/k/v bias), in process."""
    from transformers import AutoModelForCausalLM

    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams
    from vime.models import make_tiny_model

    d = make_tiny_model(tmp_path / arch, arch=arch, seed=1, tie_word_embeddings=arch == "llama")
    ref_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if arch == "llama":
        (d / "model.safetensors").unlink()
        ref_model.save_pretrained(d, max_shard_size="20KB")
        assert (d / "model.safetensors.index.json").exists()
    eng = LLMEngine(EngineConfig(str(d), block_size=4, num_kv_blocks=64, max_num_batched_tokens=16))
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    outs = {}
    while eng.has_work():
        outs.update((o.rid, o.outputs[0]) for o in eng.step())
    for i, p in enumerate(PROMPTS):
        assert outs[str(i)].output_ids == hf_greedy(ref_model, p, 10)
        assert torch.allclose(
            torch.tensor(outs[str(i)].logprobs), hf_logprobs(ref_model, p, outs[str(i)].output_ids), atol=ATOL
        )


def test_stop_strings_decode_only_a_tail_window():
    """The check widens its window past tokens that decode to nothing, finds strings that span
    tokens, and never looks at more than a short tail of a long output."""
    from vime.engine.core.stop import StopStrings

    pieces = {1: "ab", 2: "c", 3: "", 4: "d", 5: "xyz"}  # 3: a special token, skipped in the text
    seen: list[int] = []

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return "".join(pieces[i] for i in ids)

    stops = StopStrings(lambda: Tok())
    prompt = [5, 5]  # never part of the text

    def first_stop(output: list[int], strings: tuple[str, ...]) -> int | None:
        seq = SimpleNamespace(token_ids=list(prompt), prompt_len=len(prompt), stop_window=None)
        for k, tok in enumerate(output, start=1):  # as the engine does: one token at a time
            seq.token_ids.append(tok)
            if stops.completed(seq, strings):
                return k
        return None

    assert first_stop([1, 2, 4], ("bcd",)) == 3  # spans three tokens
    assert first_stop([1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2], ("bc",)) == 14  # across twelve empty tokens
    assert first_stop([2, 5, 5, 1], ("zx", "ca")) == 3  # whichever completes first: "cxyzxyz" holds "zx"
    assert first_stop([2, 1, 5, 5], ("zx", "ca")) == 2  # "cab" holds "ca"
    assert first_stop([5, 2], ("yz",)) == 1
    assert first_stop([1, 2, 4], ("xyz",)) is None  # the prompt's text does not count
    long = [2] * 2000 + [4]
    assert first_stop(long, ("cd",)) == len(long)
    # the cost: never the whole output, and about one decode per token
    seen.clear()
    assert first_stop([2] * 2000, ("cd",)) is None
    assert max(seen) <= 2 * (2 + 2 * 4 + 1) and len(seen) < 1.15 * 2000


def test_stop_string_decoder_reads_text_as_the_rollout_does():
    from vime.engine.core.stop import decoder
    from vime.models import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    ids = tok.encode("<|im_start|>a  b\n<|im_end|>c <|endoftext|>", add_special_tokens=False)
    assert decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True) == "a  b\nc "


def test_preemption_keeps_greedy_outputs(model_dir, hf, tmp_path):
    # 12 blocks x 4 tokens: one sequence fits, five at once cannot, so the scheduler must preempt.
    args = ["--num-threads", "1", "--block-size", "4", "--num-kv-blocks", "12", "--max-num-batched-tokens", "64"]
    proc = launch_engine(str(model_dir), extra_args=args, log_path=tmp_path / "engine.log")
    try:
        small = EngineClient(proc.url)
        prompts = [PROMPTS[1], PROMPTS[2][:11], [11, 12, 13], [60] * 9, [90, 80, 70, 60, 50, 40, 30]]
        outs = generate_many(small, [{"input_ids": p, "sampling_params": greedy(20, ignore_eos=True)} for p in prompts])
        metrics = engine_metrics(proc.url)
    finally:
        proc.shutdown()
    assert metrics["preemptions_total"] > 0
    for p, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(hf, p, 20)


def test_a_schedule_short_of_blocks_preempts_only_when_asked_to():
    """With a step in flight the engine asks for a schedule without preemption: a sequence
    that step ends may still hold blocks. Short of a block, that schedule takes nothing from
    anyone and says so (None); the blocks it grew stay with their sequences."""
    from vime.engine.core.kv_cache import BlockAllocator
    from vime.engine.core.sampler import SamplingParams
    from vime.engine.core.scheduler import Scheduler, Sequence

    sched = Scheduler(BlockAllocator(num_blocks=3, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = (
        Sequence(r, list(range(10 * i, 10 * i + 4)), 4, SamplingParams(), frozenset()) for i, r in ((1, "a"), (2, "b"))
    )
    for seq in (a, b):
        sched.add(seq)
    assert [n for _, n in sched.schedule()] == [4, 4]  # two prompts of one block each
    for seq in (a, b):
        seq.num_computed += 4
        seq.token_ids.append(7)
    assert sched.schedule(preempt=False) is None  # a takes the last free block, b finds none
    assert (len(a.block_table), len(b.block_table), sched.num_preemptions) == (2, 1, 0)
    assert sched.running == [a, b] and not sched.waiting
    assert [(s.rid, n) for s, n in sched.schedule()] == [("a", 1)]  # now b gives way
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b] and b.block_table == []


def test_a_lower_priority_value_is_admitted_first_and_changes_no_output(model_dir, hf):
    """Eval's requests (priority -1) overtake the rollout backlog waiting for a seat, FIFO
    within a priority, and take the seat of a running rollout when none is free (it is
    recomputed later); a request's tokens do not depend on when it was admitted."""
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    eng = LLMEngine(EngineConfig(str(model_dir), max_num_seqs=1, block_size=4, num_kv_blocks=64))
    prompts = {"a": PROMPTS[1], "b": [11, 12, 13], "c": [60] * 9, "eval1": [90, 80, 70], "eval2": PROMPTS[2][:11]}
    finished = []
    for rid, prompt in prompts.items():
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, priority=-1 if "eval" in rid else 0)
        eng.add_request(rid, prompt, params)
        if rid == "a":
            finished += eng.step()  # "a" takes the one seat before the others arrive
    while eng.has_work():
        finished += eng.step()
    # both evals, in their order, ahead of the rollouts: "a" gave its seat and ran again after them
    assert [o.rid for o in finished] == ["eval1", "eval2", "a", "b", "c"]
    assert eng.scheduler.num_preemptions == 1
    for o in finished:
        assert o.outputs[0].output_ids == hf_greedy(hf, prompts[o.rid], 6)


def test_a_rollout_that_gives_its_seat_to_an_eval_draws_the_same_tokens(model_dir):
    """Sampled at temperature 1: the rollout's draws are seeded by position, so recomputed after
    an eval took its seat it samples what it sampled alone; its log-probs agree within float32
    rounding of the recomputation (its prefill scores what decode steps scored)."""
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    def rollout(eval_at: int | None) -> tuple[list[int], list[float], int]:
        eng = LLMEngine(EngineConfig(str(model_dir), max_num_seqs=1, block_size=4, num_kv_blocks=64))
        eng.add_request(
            "r", PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=7, ignore_eos=True)
        )
        done, steps = [], 0
        while eng.has_work():
            if steps == eval_at:
                eng.add_request("e", [90, 80, 70], SamplingParams(max_new_tokens=3, temperature=0.0, priority=-1))
            done += eng.step()
            steps += 1
        out = next(o for o in done if o.rid == "r").outputs[0]
        return out.output_ids, out.logprobs, eng.scheduler.num_preemptions

    alone, beside = rollout(None), rollout(5)
    assert beside[2] == 1 and alone[2] == 0  # the eval took the rollout's one seat
    assert beside[0] == alone[0]
    assert max(abs(x - y) for x, y in zip(beside[1], alone[1])) < 1e-4


def test_torch_sampler_distribution_and_seeds():
    check_sampler(torch_sample, rows=4000)


def test_min_p_drops_the_tokens_below_its_share_of_the_likeliest():
    """vLLM's min-p: probabilities [0.79, 0.18, 0.04]; min_p 0.1 drops the last (under 0.079),
    and the draws and log-probs are those of the other two, renormalized."""
    from vime.engine.core.sampler import SamplingParams, sample

    rows = 4000
    logits = torch.tensor([0.0, -1.5, -3.0]).expand(rows, 3).contiguous()
    seeds = torch.arange(rows, dtype=torch.int32) * 7919 + 11
    tokens, lps = sample(logits, [SamplingParams(min_p=0.1)] * rows, torch.ones(rows), seeds)
    p = torch.softmax(torch.tensor([0.0, -1.5]), -1)
    share = torch.bincount(tokens, minlength=3) / rows
    assert share[2] == 0 and ((share[:2] - p).abs() <= 4 * (p * (1 - p) / rows).sqrt()).all()
    assert torch.allclose(lps, p.log()[tokens], atol=1e-5)
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams.from_dict({"min_p": 1.5})


def test_sampler_noise_stays_below_one():
    """Seed 2290 hashes column 3788 of a 4096-token vocabulary to the largest 32-bit values'
    range, where 24-bit noise rounded to exactly 1.0: infinite Gumbel noise, and that column
    won every draw (also when top-k had filtered it out)."""
    from vime.engine.core.sampler import M32, SamplingParams, mix32, sample, unit_interval

    assert int(mix32((2290 + 3788 * 0x61C88647) & M32)) >> 8 == 2**24 - 1  # the case is still the edge case
    top = torch.tensor([M32, M32 - 511, 2**31, 511, 0])
    u = unit_interval(top)
    assert bool(((u > 0) & (u < 1)).all()) and u[0] == 1 - 2**-24
    logits = torch.full((2, 4096), -20.0)
    logits[:, 0] = 20.0
    seeds = torch.tensor([2290, 2290], dtype=torch.int32)
    tokens, lps = sample(logits, [SamplingParams(top_k=4096), SamplingParams(top_k=1)], torch.ones(2), seeds)
    assert tokens.tolist() == [0, 0] and bool(torch.isfinite(lps).all())


def test_an_engine_bound_beyond_loopback_without_a_key_is_refused_in_one_line(model_dir):
    env = {k: v for k, v in os.environ.items() if k != "VIME_API_KEY"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime.engine.server",
            "--model-path",
            str(model_dir),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        "--host 0.0.0.0 would let anyone who reaches it change the weights: set --api-key"
        in proc.stderr.strip().splitlines()[-1]
    )


def test_more_seats_than_the_kv_cache_has_blocks_run_as_many_as_it_holds(model_dir, hf):
    """`--max-num-seqs 10**12` allocated the runner's buffers for that many sequences at start (an
    allocation traceback); each running sequence holds a block at least, so the engine runs at
    most as many as the cache has blocks, and says so."""
    from vime.engine.core.engine import EngineConfig, LLMEngine
    from vime.engine.core.sampler import SamplingParams

    eng = LLMEngine(EngineConfig(str(model_dir), max_num_seqs=10**12, block_size=4, num_kv_blocks=16))
    assert eng.cfg.max_num_seqs == 16
    eng.add_request("a", PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    finished = []
    while eng.has_work():
        finished += eng.step()
    assert finished[0].outputs[0].output_ids == hf_greedy(hf, PROMPTS[1], 4)
