"""The distributed weight push (trainer rank 0 → engines by broadcast) on CPU over gloo: the same
code path NCCL takes between GPUs (`vime/transport/`), with real engine servers.

An engine that received a push must generate exactly what an engine loaded from the same
weights on disk generates: same greedy tokens, same log-probs (float32, both on CPU: equal,
not close). Failures end in bounded time with the engine's URL.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest
import torch

from vime.backends.builtin.launch import launch_engine
from vime.backends.client import EngineClient, EngineError
from vime.backends.placement import choose_transports, master_address
from vime.config import Config, ConfigError
from vime.engine.core.safetensors_io import iter_safetensors
from vime.models import make_tiny_model
from vime.transport.buckets import pack
from vime.transport.group import WeightSyncError, join, open_store
from vime.transport.push import WeightPusher

PROMPTS = [[40, 41, 42], [50, 60, 70, 80, 90], list(range(10, 33))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models of one shape and different weights: the engines start from `a`, the
    trainer pushes `b`."""
    root = tmp_path_factory.mktemp("sync")
    return make_tiny_model(root / "a", arch="qwen3", seed=0), make_tiny_model(root / "b", arch="qwen3", seed=1)


def greedy_outputs(url: str) -> list[tuple[list[int], list[float], list[int]]]:
    """(tokens, log-probs, weight versions) of 12 greedy tokens for each prompt, one request at a
    time: the same batches in every engine, so equal weights give equal floats."""
    client = EngineClient(url)

    async def main():
        try:
            outs = [
                await client.generate(p, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
                for p in PROMPTS
            ]
        finally:
            await client.close()
        return [
            (o["output_ids"], o["meta_info"]["output_token_logprobs"], o["meta_info"]["output_weight_versions"])
            for o in outs
        ]

    return asyncio.run(main())


def test_gloo_push_into_two_engines_equals_loading_from_disk(models):
    a, b = models
    engines = [launch_engine(str(a)) for _ in range(2)]
    reference = launch_engine(str(b))
    try:
        before = greedy_outputs(engines[0].url)
        expected = greedy_outputs(reference.url)
        assert [t for t, _, _ in before] != [t for t, _, _ in expected]  # the push has something to change

        clients = [EngineClient(e.url) for e in engines]
        # 64 KiB buckets: the 0.35 MB model goes in several, so bucket boundaries are exercised
        pusher = WeightPusher(clients, "gloo", bucket_bytes=64 * 1024, timeout=30)
        pusher.connect("cpu")
        weights = list(iter_safetensors(b))
        metrics = pusher.push(iter(weights), version=7)
        assert metrics["perf/update_weights_buckets"] > 1
        assert metrics["perf/update_weights_bytes"] == sum(t.numel() * t.element_size() for _, t in weights)
        for c in clients:
            assert c.model_info()["weight_version"] == 7
            got = greedy_outputs(c.url)
            assert [(t, lp) for t, lp, _ in got] == [(t, lp) for t, lp, _ in expected]  # bit for bit
            assert all(v == [7] * 12 for _, _, v in got)

        # a second push on the same group: the group lives across pushes
        pusher.push(iter_safetensors(a), version=8)
        assert greedy_outputs(clients[1].url) == [(t, lp, [8] * 12) for t, lp, _ in before]
        pusher.close()
        with pytest.raises(EngineError, match="no weight group"):  # the engines left the group
            clients[0].update_weights_from_distributed(
                {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]}
            )
    finally:
        for e in [*engines, reference]:
            e.shutdown()


def test_announced_bucket_is_checked_before_anything_is_received(models):
    a, _ = models
    engine = launch_engine(str(a))
    try:
        client = EngineClient(engine.url)
        body = {
            "names": ["model.norm.weight"],
            "dtypes": ["float32"],
            "shapes": [[64]],
            "load_format": "flattened_bucket",
        }
        with pytest.raises(EngineError, match="HTTP 400.*init_weights_update_group first"):
            client.update_weights_from_distributed(body)
        pusher = WeightPusher([client], "gloo", timeout=20)
        pusher.connect("cpu")
        for bad, match in [
            ({"names": ["model.nope.weight"]}, "does not exist"),
            ({"shapes": [[65]]}, r"shape \(65,\)"),
            ({"dtypes": ["int8"]}, "dtype 'int8'"),
            ({"load_format": "zip"}, "load_format 'zip'"),
            ({"names": ["model.norm.weight", "x"]}, "one length"),
        ]:
            with pytest.raises(EngineError, match=f"HTTP 400.*{match}"):
                client.update_weights_from_distributed({**body, "group_name": "vime-weights", **bad})
        # nothing was received or changed, and the group still works
        assert client.model_info()["weight_version"] == 0
        pusher.push(iter_safetensors(a), version=1)
        assert client.model_info()["weight_version"] == 1
        pusher.close()
    finally:
        engine.shutdown()


def test_engine_killed_mid_push_stops_the_push_in_bounded_time_naming_it(models):
    a, b = models
    engine = launch_engine(str(a))
    try:
        client = EngineClient(engine.url)
        pusher = WeightPusher([client], "gloo", bucket_bytes=16 * 1024, timeout=60)
        pusher.connect("cpu")

        def weights_then_kill():
            for i, item in enumerate(iter_safetensors(b)):
                if i == 6:  # a few buckets are through: the engine dies mid-push
                    engine.proc.send_signal(signal.SIGKILL)
                    engine.proc.wait()
                yield item

        t0 = time.monotonic()
        with pytest.raises(EngineError) as err:
            pusher.push(weights_then_kill(), version=1)
        assert time.monotonic() - t0 < 30  # the dead engine is noticed, not waited out (timeout 60 s)
        assert engine.url in str(err.value) and "weight push v1" in str(err.value)
        # the aborted group was left on both sides: the next push forms a new one, which the dead
        # engine cannot join (Run.push_weights pushes to the engines still up instead)
        assert pusher._open["gloo"].group is None
        with pytest.raises(EngineError, match=f"engine at {engine.url} unreachable"):
            pusher.push(iter_safetensors(b), version=2)
    finally:
        engine.shutdown()


def test_engine_that_hangs_fails_the_join_within_the_timeout(models):
    a, _ = models
    engine = launch_engine(str(a))
    try:
        engine.proc.send_signal(signal.SIGSTOP)  # alive, but answers nothing
        pusher = WeightPusher([EngineClient(engine.url, control_timeout=60)], "gloo", timeout=3)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"engine at {engine.url} did not answer"):
            pusher.connect("cpu")
        assert time.monotonic() - t0 < 20  # the pusher's 3 s, not the client's 60 s
    finally:
        engine.proc.send_signal(signal.SIGCONT)
        engine.shutdown()


def test_a_member_that_never_comes_ends_the_rendezvous_at_the_timeout():
    store = open_store("127.0.0.1", 0, 2, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="1 of 2 members joined within 2s"):
        join("gloo", "127.0.0.1", store.port, 0, 2, "lonely", torch.device("cpu"), 2, store=store)
    assert time.monotonic() - t0 < 10


def test_a_receive_ends_when_its_group_is_torn_down_from_another_thread():
    """An engine waiting on a bucket whose sender gave up (another engine died mid-push) is told
    to leave the group: the wait ends at once, not at the group's timeout, so the engine's step
    thread is free for the trainer's next calls. Found by the Ray test, where an engine's death
    can land mid-push."""
    import threading

    store = open_store("127.0.0.1", 0, 2, timeout=30)
    groups: dict[int, object] = {}

    def member(rank: int) -> None:
        groups[rank] = join(
            "gloo",
            "127.0.0.1",
            store.port,
            rank,
            2,
            "torn",
            torch.device("cpu"),
            15,  # the group's timeout: the wait must end long before it (and rank 0's close waits it out)
            store=store if rank == 0 else None,
        )

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine = groups[1]
    work = engine.broadcast(torch.empty(1024))  # rank 0 never sends
    threading.Timer(0.5, engine.close).start()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="torn down"):
        engine.wait(work, "weight bucket")
    assert time.monotonic() - t0 < 5  # not the group's 15 s
    groups[0].close()


@pytest.mark.slow
def test_train_loop_pushes_over_gloo(tmp_path, tiny_model, addition_data):
    """train.py with --weight-transport gloo: after every push the engine samples from the
    trainer's new weights (its log-probs match the trainer's recompute), and the weights did
    move (so a missing push would show as a log-prob gap)."""
    from conftest import train_here
    from e2e.test_train import read_rows

    train, _ = addition_data
    train_here(  # in this process: the test reads what the run wrote
        "train.py",
        "--hf-checkpoint",
        str(tiny_model),
        "--prompt-data",
        str(train),
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "6",
        "--lr",
        "2e-2",
        "--num-rollout",
        "3",
        "--custom-rm-path",
        "varied_reward.digit_share",
        "--weight-transport",
        "gloo",
        "--update-weight-buffer-size",
        "65536",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "g",
    )
    rows = [r for r in read_rows(tmp_path / "g") if "perf/step_time" in r]
    assert [r["train/weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["perf/update_weights_buckets"] > 1 for r in rows)
    assert all(r["train/grad_norm"] > 0 for r in rows)
    for r in rows[1:]:  # generated after a push
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4, r["train/train_rollout_logprob_abs_diff"]
    assert "weights by gloo" in (tmp_path / "g" / "log.txt").read_text()


# ---- placement: which transport for which engine -------------------------------------------


def _info(url: str, device: str = "cpu", host: str | None = None) -> dict:
    return {"url": url, "device": device, "device_uuid": None, "hostname": host or socket.gethostname()}


def test_placement_picks_a_transport_per_engine():
    cfg = Config()
    assert choose_transports(cfg, "cpu", [_info("u0"), _info("u1", host="elsewhere")]) == ["shm", "gloo"]
    assert (
        master_address(Config(update_weights_master_address="10.0.0.5"), [_info("u1", host="elsewhere")], ["gloo"])
        == "10.0.0.5"
    )
    assert master_address(cfg, [_info("u0")], ["shm"]) == "127.0.0.1"
    with pytest.raises(ConfigError, match="u1 runs on host elsewhere: give --update-weights-master-address"):
        master_address(cfg, [_info("u1", host="elsewhere")], ["gloo"])
    with pytest.raises(ConfigError, match="nccl needs trainer and engine on different GPUs"):
        choose_transports(Config(weight_transport="nccl"), "cpu", [_info("u0")])
    with pytest.raises(ConfigError, match="cuda_ipc needs the engine on the trainer's GPU"):
        choose_transports(Config(weight_transport="cuda_ipc"), "cpu", [_info("u0")])
    assert choose_transports(Config(weight_transport="disk"), "cpu", [_info("u0")]) == ["disk"]


def test_every_transport_is_a_row_of_the_table_and_one_group_serves_a_run():
    """--weight-transport's values are the table's rows (and auto); a pusher makes each row's
    `Transport` where it is used, and refuses engines that would need two weight groups."""
    from vime.transport import TRANSPORT_CLASSES, TRANSPORTS
    from vime.transport.base import Transport

    assert ("auto", *TRANSPORT_CLASSES) == TRANSPORTS
    pusher = WeightPusher([], [])
    for name in TRANSPORT_CLASSES:
        assert isinstance(pusher._transport(name), Transport) and pusher._transport(name).name == name
    assert [n for n in TRANSPORT_CLASSES if pusher._transport(n).streams] == ["nccl", "gloo"]
    with pytest.raises(ValueError, match="unknown weight transport 'tcp'"):
        WeightPusher([EngineClient("http://127.0.0.1:1")], "tcp")
    two = WeightPusher([EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")], ["nccl", "gloo"])
    with pytest.raises(ValueError, match="one weight group per run: the engines' transports mix nccl and gloo"):
        two.connect("cpu")


def test_buckets_are_flat_bounded_and_cast_to_the_engine_dtype():
    g = torch.Generator().manual_seed(0)
    w = [
        ("a", torch.randn(10, generator=g)),
        ("b", torch.randn(2, 5, generator=g)),
        ("c", torch.randn(100, generator=g)),
        ("d", torch.randn(3, generator=g)),
    ]
    # 40 elements of bfloat16 per bucket: a+b fit, c (100) goes alone, d starts the next
    buckets = list(pack(iter(w), 80, torch.bfloat16, torch.device("cpu")))
    assert [[n for n, _ in items] for items, _ in buckets] == [["a", "b"], ["c"], ["d"]]
    for items, flat in buckets:
        assert flat.dtype == torch.bfloat16 and flat.dim() == 1
        assert torch.equal(flat, torch.cat([t.reshape(-1) for _, t in items]).to(torch.bfloat16))


# ---- proof of arrival, routing, and an engine that dies ----------------------------------------


def test_every_push_is_checked_against_what_the_engine_holds(models):
    """The engine reads its parameters back (GET /weight_checksums) and the trainer compares them
    with what it sent, per tensor, on every transport: a difference is one line naming the engine
    and the tensor, never a silent mix."""
    a, b = models
    engine = launch_engine(str(a))
    try:
        client = EngineClient(engine.url)
        held_a = client.weight_checksums()
        for transport in ("shm", "gloo"):
            pusher = WeightPusher([client], transport, timeout=30)
            metrics = pusher.push(iter_safetensors(b), version=1)
            assert metrics["perf/update_weights_check_time"] > 0
            sent = pusher._sent[torch.float32]
            assert set(sent) == {n for n, _ in iter_safetensors(b)}
            name = "model.layers.1.mlp.down_proj.weight"
            assert sent[name] != held_a[name]  # the engine's answer changed with the push
            sent[name] = [sent[name][0] + 1, sent[name][1]]  # one bit of one element
            with pytest.raises(EngineError, match=f"engine at {engine.url} does not hold what the trainer sent, 1 of"):
                pusher.verify(1)
            pusher.close()
        # a trainer whose weights never reached the engine (pushed elsewhere) is caught the same way
        pusher = WeightPusher([client], "shm", timeout=30)
        pusher._sent = {torch.float32: dict(held_a)}  # what it would have sent had it pushed a
        with pytest.raises(EngineError, match="tensors differ"):
            pusher.verify(2)
    finally:
        engine.shutdown()


def test_requests_go_to_the_least_loaded_engine_and_a_group_stays_on_one():
    from vime.rollout.runtime import RolloutRuntime

    rt = RolloutRuntime([EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")], None)
    first = rt.pick(group_index=0, cost=100)
    assert first.index == 0 and rt.pick(group_index=0, cost=100) is first  # the group's prefix is cached there
    other = rt.pick(group_index=1, cost=10)
    assert other.index == 1  # engine 0 holds 200 tokens in flight, engine 1 none
    assert rt.pick(group_index=2, cost=10).index == 1  # 200 against 10
    rt.release(first, 100)
    rt.release(first, 100)
    assert rt.pick(group_index=3, cost=10).index == 0  # 0 against 20
    rt.engines[1].state = "restarting"
    assert rt.pick(group_index=1, cost=5).index == 0  # an engine that is not up gets nothing
    rt.engines[0].state = "down"
    with pytest.raises(EngineError, match="no engine left to generate with"):
        rt.pick(group_index=4, cost=1)
    assert rt.metrics()["rollout/engine0_requests"] == 4


@pytest.mark.slow
def test_two_engines_share_a_run_and_a_killed_one_comes_back(tmp_path, tiny_model, addition_data):
    """--rollout-num-engines 2; engine 1 SIGKILLed mid-rollout: its requests finish on engine 0,
    it is started again, re-synced by the next push, and takes work again; sync's log-probs
    equal the trainer's at every step, so no sample came from old weights."""
    from conftest import train_here
    from fault_plugins import check_engine_one_came_back

    train, _ = addition_data
    train_here(  # in this process (its engines are its children, as a run's are): the test reads what it wrote
        "train.py", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(train),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
        "--lr", "2e-2", "--num-rollout", "5", "--custom-rm-path", "varied_reward.digit_share",
        "--custom-generate-function-path", "fault_plugins.kill_engine_one", "--rollout-num-engines", "2",
        "--runs-dir", str(tmp_path), "--run-name", "two",
    )  # fmt: skip
    check_engine_one_came_back(tmp_path / "two")
