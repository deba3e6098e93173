"""The run's config once assembled (frozen, derived values in new configs), the read-only `args`
plug-ins get, and the launcher table."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from vime.config import Config
from vime.launch.launcher import LAUNCHERS, launcher_for
from vime.plugin_args import PluginArgs
from vime.plugins import SettingWriteError, read_only


def test_a_frozen_config_refuses_a_write_in_one_line_and_its_copies_are_free():
    cfg = Config(rollout_batch_size=4).freeze()
    with pytest.raises(dataclasses.FrozenInstanceError) as e:
        cfg.num_rollout = 3
    assert str(e.value).startswith("args.num_rollout: the run's config is frozen") and "RunContext" in str(e.value)
    assert "\n" not in str(e.value)
    for clone in (copy.copy(cfg), copy.deepcopy(cfg), cfg.derived(num_rollout=3)):
        clone.lr = 0.5  # a copy is its own
        assert clone.rollout_batch_size == 4 and cfg.lr != 0.5
    assert cfg.derived(num_rollout=3).num_rollout == 3 and cfg.num_rollout is None
    with pytest.raises(dataclasses.FrozenInstanceError):  # a trainer rank's copy stays frozen
        pickle.loads(pickle.dumps(cfg)).lr = 0.5


def test_derived_keeps_what_custom_config_gave_plugins():
    cfg = Config()
    cfg.my_plugin_setting = 7  # as --custom-config-path sets a key that is no vime setting
    assert cfg.derived(model_dir="/m").my_plugin_setting == 7


def test_plugin_args_read_every_setting_and_the_live_objects_and_write_nothing():
    from vime.compat import SLIME

    runtime = object()
    cfg = Config(rollout_batch_size=4, dialect=SLIME).freeze()
    args = PluginArgs(cfg, runtime)
    # slime's names on args (the router's address, None without one), as its dialect says
    assert args.rollout_batch_size == 4 and args.runtime is runtime and args.vllm_router_ip is None
    assert not hasattr(PluginArgs(Config().freeze(), runtime), "vllm_router_ip")  # vime's own have none
    assert args.steps_per_rollout == cfg.steps_per_rollout  # properties and methods too
    with pytest.raises(
        AttributeError, match=r"^args.group_rm: a setting of the run, read-only .*copy.deepcopy\(args\)"
    ):
        args.group_rm = True
    args.tau_bench_config = "mine"  # a name that is no setting: the plug-in's own (vllm-project/vime's tau-bench)
    assert args.tau_bench_config == "mine" and not hasattr(cfg, "tau_bench_config")
    assert copy.copy(args).tau_bench_config == "mine"
    args.agent_table = {"k": 1}
    copy.deepcopy(args).agent_table["k"] = 2  # a deep copy's own names are its own
    assert args.agent_table == {"k": 1}
    for mine in (copy.copy(args), copy.deepcopy(args)):  # vllm-project/vime's multi-agent example copies, then changes
        mine.rollout_batch_size = 2
        assert isinstance(mine, Config) and mine.runtime is runtime and args.rollout_batch_size == 4
    assert pickle.loads(pickle.dumps(args)).rollout_batch_size == 4


@pytest.mark.parametrize(
    "write",
    [
        lambda a: setattr(a, "lr", 5.0),
        lambda a: delattr(a, "lr"),  # used to fall back to the class default
        lambda a: vars(a).__setitem__("lr", 5.0),  # vars() used to be the config's own __dict__
        lambda a: vars(a).update(lr=5.0),
        lambda a: vars(a).pop("lr"),
    ],
)
def test_no_write_of_a_plugin_reaches_a_setting_and_each_names_it(write):
    """Every path a plug-in may write `args.lr` by is refused in one line naming the setting, on
    the run's view (`PluginArgs`) and the view the trainer's hooks get (`read_only`); a frozen
    config refuses `del` too."""
    cfg = Config(lr=1e-3).freeze()
    for view in (PluginArgs(cfg, object()), read_only(cfg)):
        with pytest.raises(SettingWriteError, match=r"^args\.lr: a setting of the run, read-only in a plug-in"):
            write(view)
    assert cfg.lr == 1e-3 and "lr" in vars(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError, match="^args.lr: the run's config is frozen"):
        del cfg.lr
    assert vars(PluginArgs(cfg, None))["lr"] == 1e-3  # vars() still reads


def test_the_launcher_is_a_row_and_auto_is_local_outside_a_ray_job(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert launcher_for(Config(launcher="ray")) is LAUNCHERS["ray"]
    assert launcher_for(Config()).name == "local"
    assert list(LAUNCHERS)[-1] == "local"  # the row auto falls back on


def test_the_launcher_rows_are_the_flags_choices_and_each_makes_its_launcher():
    from vime.config.schema import FIELDS
    from vime.launchers import LAUNCHER_ROWS

    assert FIELDS["launcher"].metadata["choices"] == ("auto", *LAUNCHER_ROWS)
    assert [launcher.name for launcher in LAUNCHERS.values()] == list(LAUNCHER_ROWS)


def test_the_start_up_clock_counts_imports_once_per_process():
    """The process's start read from /proc lies in the past (less than a day: a test process);
    a second run in one process (a notebook, train_here) has no imports phase and starts its
    clock when it is made, not at the process's start."""
    import re
    import sys
    import time

    from vime.startup import StartupClock, process_start

    started = process_start()
    if sys.platform == "linux":  # /proc is there
        assert started is not None and 0 <= time.time() - started < 86400
    StartupClock()  # the process's first, if no run in this process took it yet
    later = StartupClock()
    assert "imports" not in dict(later.phases) and abs(later.started - time.time()) < 1.0
    with later.phase("work"):
        time.sleep(0.05)
    assert dict(later.phases)["work"] >= 0.05
    line = later.line("before work")
    assert line.startswith("start-up ") and " s before work: " in line and "imports" not in line and "work " in line
    later.parts["work"] = [("a", 0.04), ("b", 0.01)]  # a phase's own split follows it in brackets
    line = later.line("before work")
    assert re.search(r"work [\d.]+ \(a 0\.0, b 0\.0\), other ", line), line


def test_an_engine_is_built_without_the_compiler_stack(tiny_model):
    """The engine compiles nothing, so building one imports no torch._dynamo: the meta-device
    build's random init and RoPE's arange did, seconds of every engine's start on a GPU host
    (bench/RESULTS.md). A fresh interpreter, since this one has imported it long ago."""
    import subprocess
    import sys

    code = (
        "import sys; from vime.engine.core.engine import EngineConfig, LLMEngine; "
        "LLMEngine(EngineConfig(sys.argv[1], block_size=4, num_kv_blocks=8)); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_an_engine_sizes_its_kv_cache_only_once_the_trainer_is_ready(tmp_path, tiny_model):
    """`--wait-for-file`: an engine starting beside a trainer on its GPU loads its weights, then
    waits for the run's TRAINER_READY before sizing the KV cache from free memory; a fixed
    cache size needs no wait."""
    import threading
    import time

    from vime.engine.core.engine import EngineConfig, LLMEngine

    gate = tmp_path / "trainer-ready"
    built: list[LLMEngine] = []
    cfg = EngineConfig(str(tiny_model), block_size=4, num_kv_blocks=None, kv_cache_gb=None, wait_for_file=str(gate))
    thread = threading.Thread(target=lambda: built.append(LLMEngine(cfg)), daemon=True)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive() and not built  # waiting: the trainer holds no memory yet
    gate.touch()
    thread.join(timeout=60)
    assert built and built[0].allocator.num_blocks > 0  # sized from what is free
    fixed = LLMEngine(
        EngineConfig(str(tiny_model), block_size=4, num_kv_blocks=8, wait_for_file=str(tmp_path / "never"))
    )
    assert fixed.allocator.num_blocks == 8


def test_engines_wait_for_the_trainer_only_on_its_gpus():
    from vime.backends import BACKENDS
    from vime.backends.placement import shares_trainer_gpu
    from vime.backends.settings import PlacementConfig

    two = Config(actor_num_gpus_per_node=2).placement
    assert isinstance(two, PlacementConfig)
    assert shares_trainer_gpu("cuda:1", two) and shares_trainer_gpu("cuda", two)
    assert not shares_trainer_gpu("cuda:2", two) and not shares_trainer_gpu("cpu", two)
    assert shares_trainer_gpu("cuda:2,1", two) and not shares_trainer_gpu("cuda:2,3", two)
    # vLLM measures the GPU as it starts, so only the built-in engine starts beside the trainer
    assert BACKENDS["vime"].starts_beside_trainer and not BACKENDS["vllm"].starts_beside_trainer


def test_a_launched_engine_waits_for_its_gate_past_the_start_timeout(tmp_path, tiny_model):
    """An engine launched with a gate (a trainer on its GPU still building) is not timed out while
    the gate is missing, however long the build takes: its start timeout counts from the gate."""
    import threading
    import time

    from vime.backends.builtin.launch import launch_engine

    gate = tmp_path / "trainer-ready"
    done: list = []

    log_path = tmp_path / "engine.log"

    def start() -> None:
        done.append(launch_engine(str(tiny_model), log_path=log_path, startup_timeout=5.0, gate=gate))

    thread = threading.Thread(target=start, daemon=True)
    t0 = time.monotonic()
    thread.start()
    while "waiting for" not in (log_path.read_text() if log_path.exists() else ""):  # loaded, at the gate
        assert thread.is_alive() and time.monotonic() - t0 < 120, "the engine never reached its gate"
        time.sleep(0.1)
    time.sleep(max(0.0, 5.5 - (time.monotonic() - t0)))  # past the start timeout, the gate still missing
    assert thread.is_alive() and not done
    gate.touch()
    thread.join(timeout=120)
    try:
        assert done and done[0].url.startswith("http://")
    finally:
        for engine in done:
            engine.shutdown()
