"""The fully-async worker (vime/rollout/fully_async_rollout.py), in process, against a real
engine: the warm queue, batch size and cap, aborted groups re-queued and trained later, a clean
shutdown, evaluation refused, and a resumed sample that ends at a stop string its partial began
or held. Whole async runs: tests/e2e/test_async.py."""

from __future__ import annotations

import time

import pytest

# ---- the fully-async worker, in process, against a real engine ----


@pytest.fixture(scope="module")
def engine(tiny_model):
    from vime.backends.builtin.launch import launch_engine

    e = launch_engine(str(tiny_model), device="cpu", dtype="float32")
    yield e
    e.shutdown()


@pytest.fixture
def worker_env(engine, tiny_model, addition_data):
    from vime.backends import BACKENDS
    from vime.config import parse_args
    from vime.models import load_tokenizer
    from vime.rollout import fully_async_rollout
    from vime.rollout.data.source import DataSource
    from vime.rollout.rewards import Rewards
    from vime.rollout.runtime import RolloutRuntime

    args = parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(addition_data[0]),
            "--num-rollout",
            "1",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-concurrency",
            "3",
            "--rollout-max-response-len",
            "6",
        ]
    )
    args.model_dir = str(tiny_model)
    args.rollout_engine_urls = [engine.url]
    tokenizer = load_tokenizer(tiny_model)
    rewards = Rewards(args)
    args.runtime = RolloutRuntime([BACKENDS["vime"].make_client(engine.url)], tokenizer, rewards=rewards)
    ds = DataSource(args, tokenizer)
    yield args, ds, fully_async_rollout
    args.runtime.close()
    rewards.close()


def _worker(args, ds):
    """The run's worker, started here at rollout 0 if the rollout function has not yet."""
    from vime.rollout.fully_async_rollout import AsyncRolloutWorker

    if args.runtime.worker is None:
        args.runtime.worker = AsyncRolloutWorker(args, ds, 0, args.runtime.engine_version)
    return args.runtime.worker


def _wait_for(cond, timeout=20.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "condition not reached in time"
        time.sleep(0.02)


def test_worker_warm_queue_batch_size_and_cap(worker_env):
    args, ds, fa = worker_env
    first = fa.generate_rollout_fully_async(args, 0, ds)
    assert len(first.samples) == 2 and all(len(g) == 2 for g in first.samples)
    # each sample carries the temperature it was drawn at, which the trainer scores it at
    assert {s.temperature for g in first.samples for s in g} == {args.rollout_temperature}
    w = _worker(args, ds)
    # between calls the worker keeps working: a batch is being (or has been) generated already
    _wait_for(lambda: len(w.ready) >= 2)
    assert w.inflight + len(w.ready) >= 2
    second = fa.generate_rollout_fully_async(args, 1, ds)
    assert len(second.samples) == 2
    seen = {s.index for g in first.samples + second.samples for s in g}
    assert len(seen) == 8  # no sample trained twice
    assert w.max_inflight_seen <= 3  # --rollout-concurrency
    assert len(w.ready) <= 2 + 3  # back-pressure: intake stops while a full batch waits


def test_worker_requeues_aborted_groups_and_trains_them_later(worker_env, engine):
    from vime.backends.client import EngineClient
    from vime.rollout.types import Status

    args, ds, fa = worker_env
    args.rollout_max_response_len = 200  # long responses, so the abort lands mid-generation
    requeued: list[str] = []
    original = ds.add_samples

    def spy(groups):
        requeued.extend(g[0].prompt for g in groups)
        original(groups)

    ds.add_samples = spy
    w = _worker(args, ds)
    for _ in range(200):  # abort while something is in flight, until a group comes back aborted
        if w.counts["requeued"] > 0:
            break
        if w.inflight > 0:
            EngineClient(engine.url).abort_request(abort_all=True)
            time.sleep(0.05)
        elif len(w.ready) >= w.batch:
            fa.generate_rollout_fully_async(args, 0, ds)  # make room: back-pressure holds intake while a batch waits
        else:
            time.sleep(0.01)
    assert w.counts["requeued"] > 0
    args.rollout_max_response_len = 6
    trained = []
    for i in range(12):
        out = fa.generate_rollout_fully_async(args, i, ds)
        trained += [g for g in out.samples]
        if set(requeued) <= {g[0].prompt for g in trained}:
            break
    assert requeued and set(requeued) <= {g[0].prompt for g in trained}
    assert all(s.status != Status.ABORTED for g in trained for s in g)


def test_worker_shuts_down_cleanly(worker_env, engine):
    args, ds, fa = worker_env
    w = _worker(args, ds)
    _wait_for(lambda: w.inflight > 0 or len(w.ready) > 0)
    args.runtime.close()
    assert w._task.done()
    # the worker's requests were aborted at the engine too: nothing keeps generating for it
    _wait_for(lambda: _running(engine.url) == 0, timeout=10)


def _running(url: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("vime_engine_num_running ", "vime_engine_num_waiting "))
    )


def test_fully_async_refuses_evaluation(worker_env):
    args, ds, fa = worker_env
    with pytest.raises(ValueError, match="does not evaluate"):
        fa.generate_rollout_fully_async(args, 0, ds, evaluation=True)


@pytest.mark.parametrize("inside", [2, 0])
def test_a_resumed_sample_ends_at_a_stop_string_its_partial_began_or_held(engine, tiny_model, inside):
    """An engine matches stop strings on its own output only. A sample aborted by a weight
    update while its last tokens were part of a stop string (`inside` of its tokens still to come),, or once they held it whole, was resumed past it: the engine never saw the string whole
    in what it wrote, and the model wrote on to the end of its budget. The real engine and the
    tiny model, greedy: the stop string is text the model writes anyway."""
    import asyncio

    from vime.backends import BACKENDS
    from vime.config import Config
    from vime.models import load_tokenizer
    from vime.rollout.generate import generate, sampling_params
    from vime.rollout.runtime import RolloutRuntime
    from vime.rollout.types import Sample, Status

    tokenizer = load_tokenizer(tiny_model)
    args = Config(
        hf_checkpoint=str(tiny_model), prompt_data="unused.jsonl", num_rollout=1, rollout_max_response_len=40
    ).validate("sync")
    args.rollout_temperature = 0.0
    args.runtime = RolloutRuntime([BACKENDS["vime"].make_client(engine.url)], tokenizer)
    prompt = list(tokenizer.encode("6+9=", add_special_tokens=False))

    def params() -> dict:  # the random model may draw its end token early: written past it
        return dict(sampling_params(args), ignore_eos=True)

    try:
        free = asyncio.run(generate(args, Sample(index=0, tokens=list(prompt)), params()))
        ids = free.response_tokens
        stop = tokenizer.decode(ids[10:14], skip_special_tokens=True)  # written after 10 tokens, ends at token 14
        assert len(ids) == 40 and all(tokenizer.decode(ids[i : i + 1], skip_special_tokens=True) for i in (12, 13))
        assert stop not in tokenizer.decode(ids[:13], skip_special_tokens=True)
        args.rollout_stop = [stop]
        # the engine stops there when it writes the string itself
        whole = asyncio.run(generate(args, Sample(index=0, tokens=list(prompt)), params()))
        assert whole.response_tokens == ids[:14] and whole.status == Status.COMPLETED
        k = 14 - inside  # aborted with `inside` of the string's tokens to come
        aborted = Sample(index=0, tokens=prompt + ids[:k], response_length=k, status=Status.ABORTED)
        aborted.rollout_log_probs, aborted.weight_versions = [-0.5] * k, [0] * k
        resumed = asyncio.run(generate(args, aborted, params()))
    finally:
        args.runtime.close()
    assert resumed.status == Status.COMPLETED and resumed.response_tokens == ids[:14]
    assert resumed.response == tokenizer.decode(ids[:14], skip_special_tokens=True) and resumed.response.endswith(stop)
    assert len(resumed.rollout_log_probs) == len(resumed.weight_versions) == 14
    assert resumed.rollout_log_probs[:k] == [-0.5] * k  # what it had is kept as it was
