import pytest
import yaml
from conftest import run_cli

from vime.config import ASYNC_CORRECTION, DEFAULT_ROLLOUT_FN, FULLY_ASYNC_FN, Config, ConfigError, parse_args
from vime.preflight import startup_notes

BASE = ["--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl", "--num-rollout", "2"]


def test_flags_yaml_overlay_and_precedence(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "rollout-batch-size: 4\nn_samples_per_prompt: 2\nlr: 3.0e-6\napply_chat_template_kwargs: {enable_thinking: false}\n"
    )
    args = parse_args(["--config", str(cfg), *BASE, "--lr", "1e-5", "--colocate"])
    assert args.rollout_batch_size == 4 and args.n_samples_per_prompt == 2
    assert args.lr == 1e-5  # the flag wins over the file
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    assert args.colocate is True
    assert args.global_batch_size == 8  # default: one optimizer step per rollout
    assert args.eps_clip_high == args.eps_clip


def test_json_and_list_flags():
    args = parse_args(
        [*BASE, "--apply-chat-template-kwargs", '{"enable_thinking": false}', "--rollout-stop-token-ids", "5,7"]
    )
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    assert args.rollout_stop_token_ids == [5, 7]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            ["--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
            "not a multiple of --global-batch-size",
        ),
        (["--save-interval", "2"], "--save-interval needs --save"),
        (["--eval-interval", "2"], "--eval-interval needs --eval-prompt-data"),
        (["--rollout-top-p", "0"], "--rollout-top-p"),
        (["--apply-chat-template-kwargs", "{not json"], "--apply-chat-template-kwargs"),
        (["--num-rollout", "two"], "--num-rollout"),
        (["--partial-rollout"], "--max-staleness"),
        (["--update-in-flight", "abort"], "has nothing in flight at a push"),
        (["--partial-rollout", "--update-in-flight", "abort"], "give one"),
        (["--off-policy-correction", "m2po", "--m2-threshold", "0.1"], "--off-policy-correction custom"),
        (["--m2-threshold", "0"], "--m2-threshold"),
        (["--max-staleness", "0", "--update-weights-interval", "2"], "raise --max-staleness to 1"),
        (
            [
                "--max-staleness",
                "1",
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "4",
                "--global-batch-size",
                "4",
            ],
            "raise --max-staleness to 3",
        ),
        (["--use-rollout-logprobs", "--use-tis"], "drop one"),
        (["--use-tis", "--tis-clip-low", "2"], "--tis-clip-low"),
        (["--use-rs", "--rs-lower-bound", "3"], "--rs-lower-bound"),
        (["--eps-clip-c", "1"], "--eps-clip-c 1.0 must be above 1"),
        (
            ["--no-calculate-per-token-loss", "--advantage-estimator", "dr_grpo"],
            "Dr. GRPO divides by a constant, not by tokens or samples",
        ),
        (["--max-staleness", "2"], "run it with train_async.py"),
        (["--rollout-num-gpus-per-engine", "2"], "has no tensor parallelism"),
        (["--rollout-num-gpus-per-engine", "0"], "must be at least 1"),
        (["--reward-timeout", "0"], "--reward-timeout 0 must be > 0 seconds"),
        (
            ["--dynamic-sampling-filter-path", "f.g", "--over-sampling-batch-size", "1"],
            "--over-sampling-batch-size 1 is below --rollout-batch-size",
        ),
        (["--over-sampling-batch-size", "16"], "only matters with --dynamic-sampling-filter-path"),
        (["--debug-train-only"], "give --load-debug-rollout-data"),
        (["--debug-rollout-only", "--max-staleness", "1"], "would hold the worker back forever"),
        (
            ["--save-debug-rollout-data", "a/{rollout_id}.pt", "--load-debug-rollout-data", "a/{rollout_id}.pt"],
            "would write back what was read",
        ),
        (["--opsm-delta", "0.5"], "add --use-opsm"),
        (
            ["--loss-type", "custom_loss", "--custom-loss-function-path", "m.f", "--advantage-estimator", "gspo"],
            "--loss-type custom_loss replaces the policy term",
        ),
        (["--loss-type", "custom_loss"], "needs --custom-loss-function-path"),
        (["--custom-loss-function-path", "m.f"], "is used with --loss-type custom_loss"),
        (["--gamma", "0.99"], "it needs --advantage-estimator reinforce_plus_plus"),
        (["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0"], "must be in (0, 1]"),
        (["--advantage-estimator", "cispo", "--eps-clip-c", "3"], "CISPO clips the importance weight instead"),
        (["--rs-veto-threshold", "2"], "must be between 0 and 1"),
        (["--lora-rank", "-1"], "--lora-rank -1 must be >= 1"),
        (
            ["--lora-alpha", "32", "--target-modules", "q_proj", "v_proj"],
            "--lora-alpha --target-modules shape LoRA adapters, but --lora-rank is 0 (full fine-tuning)",
        ),
        (["--tis-level", "sequence"], "add --use-tis, or drop --tis-level"),
        (["--debug-rollout-only", "--load-debug-rollout-data", "d/{rollout_id}.pt"], "give one of them"),
        (["--debug-rollout-only", "--save", "ck"], "drop --save/--load"),
        (
            ["--save-debug-rollout-data", "dbg/"],
            "put {rollout_id} in the path (one file per rollout), e.g. dbg/{rollout_id}.pt",
        ),
        (["--rollout-engine-urls", "not a url"], "--rollout-engine-urls: 'not a url' is not an engine URL"),
        (["--rollout-engine-urls", "http://h:port"], "'http://h:port' is not an engine URL"),
        (["--reward-timeout", "-1"], "--reward-timeout -1 must be > 0 seconds"),
        (
            ["--rollout-backend", "vllm", "--weight-transport", "shm"],
            "does not reach vllm engines (they receive by nccl",
        ),
        (["--launcher", "ray", "--rollout-engine-urls", "http://h:1"], "give one of the two"),
        (["--launcher", "ray", "--colocate"], "--colocate puts the engines on the trainer's GPUs"),
        (
            ["--engine-quantization", "fp8", "--rollout-backend", "vllm"],
            "engines take their own flag for it: use --vllm-quantization fp8_per_channel instead",
        ),
        (
            ["--engine-quantization", "fp8", "--rollout-engine-urls", "http://h:1"],
            "start those with --quantization fp8 instead",
        ),
        (
            ["--engine-num-kv-blocks", "512", "--rollout-backend", "vllm"],
            "engines take their own flag for it: use --vllm-num-gpu-blocks-override N instead",
        ),
        (
            ["--engine-num-kv-blocks", "512", "--rollout-engine-urls", "http://h:1"],
            "start those with --num-kv-blocks 512 instead",
        ),
    ],
)
def test_inconsistent_settings_fail_with_one_line(extra, fragment):
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, *extra])
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--num-epoch", "0"], "--num-epoch 0: give at least 1"),  # trained nothing, rc 0
        (["--num-epoch", "-2"], "--num-epoch -2: give at least 1"),  # config.yaml said num_rollout -40
        (["--save", "ck", "--save-interval", "-1"], "--save-interval -1: give at least 1"),  # saved every step
        (["--eval-prompt-data", "t.jsonl", "--eval-interval", "-1"], "--eval-interval -1: give at least 1"),
        (["--n-samples-per-eval-prompt", "0"], "--n-samples-per-eval-prompt 0: give at least 1"),  # 0/0 accuracy
        (["--rollout-top-k", "-5"], "--rollout-top-k must be -1 or 0 (off)"),  # as --eval-top-k is
        (["--logprob-chunk-size", "0"], "--logprob-chunk-size 0: give at least 1"),  # one-token chunks
        (["--seed", str(2**70)], f"--seed {2**70}: a seed is 64 bits"),  # torch.manual_seed's traceback, mid-start
        (["--engine-max-num-seqs", "0"], "--engine-max-num-seqs 0: give at least 1"),  # the engine's refusal
        (["--engine-num-kv-blocks", "0"], "--engine-num-kv-blocks 0: give at least 1"),  # meant "from memory"
        # the engine refused these at step 1's first request
        (["--rollout-stop-token-ids", '["x"]'], "every stop token id must be a whole number >= 0"),
        (["--rollout-stop-token-ids", "[1.5]"], "every stop token id must be a whole number >= 0"),
        (["--rollout-stop-token-ids", "[-3]"], "every stop token id must be a whole number >= 0"),  # never matched
    ],
)
def test_settings_out_of_range_are_refused_before_anything_starts(extra, fragment):
    """Values that passed every check and ran silently wrong (or failed only once an engine had started)."""
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, *extra])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_yaml_mapping_for_a_list_setting_is_refused(tmp_path):
    """`rollout_stop: {a: 1}` in a run file became the stop string "{'a': 1}", unsaid."""
    path = tmp_path / "run.yaml"
    path.write_text("rollout_stop: {a: 1}\n")
    with pytest.raises(ConfigError, match=r"--rollout-stop: cannot read \{'a': 1\} as a JSON list"):
        parse_args(["--config", str(path), *BASE])


def test_flags_the_other_settings_leave_nothing_to_do_are_named_at_start_up(tmp_path):
    """A floor on the learning rate under a constant schedule, Adam's betas under SGD, template
    arguments for prompts sent as plain text: accepted (slime's scripts carry such flags) and
    named on start-up's "no effect" line, never dropped without a word."""
    from vime.config.checks_train import inert_flags

    base = ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-rollout", "1"]
    assert inert_flags(parse_args(base)) == []
    templated = tmp_path / "eval.yaml"  # an eval set that renders its prompts with the template
    templated.write_text("eval:\n  datasets:\n    - name: a\n      path: a.jsonl\n      apply_chat_template: true\n")
    cases = {
        ("--min-lr", "1e-7"): ["--min-lr 1e-07 (--lr-decay-style constant never decays)"],
        ("--lr-decay-iters", "50"): ["--lr-decay-iters 50 (--lr-decay-style constant never decays)"],
        ("--lr-decay-iters", "50", "--lr-warmup-fraction", "0.1"): [],  # the warm-up is a share of it
        ("--lr-decay-iters", "50", "--min-lr", "1e-7", "--lr-decay-style", "cosine"): [],
        ("--optimizer", "sgd", "--adam-beta2", "0.95"): ["--adam-beta2 0.95 (--optimizer sgd)"],
        ("--sgd-momentum", "0.5"): ["--sgd-momentum 0.5 (--optimizer adam)"],
        ("--optimizer", "sgd", "--sgd-momentum", "0.5"): [],
        ("--apply-chat-template-kwargs", '{"enable_thinking": false}'): [
            '--apply-chat-template-kwargs {"enable_thinking": false} (prompts are plain text without --apply-chat-template)'
        ],
        ("--apply-chat-template-kwargs", '{"enable_thinking": false}', "--apply-chat-template"): [],
        ("--apply-chat-template-kwargs", '{"enable_thinking": false}', "--eval-config", str(templated)): [],
    }
    for extra, said in cases.items():
        cfg = parse_args([*base, *extra])
        assert inert_flags(cfg) == said, extra
        line = " ".join(startup_notes(cfg))
        assert all(f"flags with no effect in vime: {s}" in line for s in said)


def test_async_colocate_is_refused_by_the_async_entry_only():
    assert parse_args([*BASE, "--colocate"]).colocate
    with pytest.raises(ConfigError, match="train_async.py cannot --colocate"):
        parse_args([*BASE, "--colocate"], entry="async")


@pytest.mark.parametrize(
    "entry, extra, mode, fn",
    [
        ("sync", [], "sync", DEFAULT_ROLLOUT_FN),
        ("async", [], "one-step-off", DEFAULT_ROLLOUT_FN),
        ("async", ["--rollout-function-path", FULLY_ASYNC_FN], "fully-async", FULLY_ASYNC_FN),
        ("async", ["--max-staleness", "1"], "decoupled", FULLY_ASYNC_FN),  # decoupled needs the continuous worker
        ("async", ["--max-staleness", "1", "--rollout-function-path", "my.rollout"], "one-step-off", "my.rollout"),
    ],
)
def test_the_mode_is_derived_in_one_place(entry, extra, mode, fn):
    args = parse_args([*BASE, *extra], entry=entry)
    assert (args.mode, args.rollout_function_path) == (mode, fn)
    assert args.to_dict()["mode"] == mode and "runtime" not in args.to_dict()


def test_a_debug_rollout_path_may_format_the_rollout_id():
    """`{rollout_id:04d}` names a file per rollout as `{rollout_id}` does (the check looked for the
    literal text and refused it with a suggestion that was no better)."""
    args = parse_args([*BASE, "--save-debug-rollout-data", "dbg/{rollout_id:04d}.pt"])
    assert args.save_debug_rollout_data == "dbg/{rollout_id:04d}.pt"


def test_what_a_push_does_to_the_groups_in_flight():
    """--partial-rollout is --update-in-flight resume, in fully-async runs too; m2po is a
    correction of its own, picked by name or by giving its threshold."""
    fully = ["--rollout-function-path", FULLY_ASYNC_FN]
    assert parse_args([*BASE, *fully], entry="async").update_in_flight == "keep"
    assert parse_args([*BASE, *fully, "--partial-rollout"], entry="async").update_in_flight == "resume"
    assert (
        parse_args([*BASE, "--max-staleness", "2", "--update-in-flight", "abort"], entry="async").update_in_flight
        == "abort"
    )
    m2po = parse_args([*BASE, *fully, "--off-policy-correction", "m2po"], entry="async")
    assert (m2po.m2_threshold, m2po.use_tis) == (0.04, False) and "0.04" in m2po.correction_summary()
    mine = parse_args([*BASE, *fully, "--m2-threshold", "0.1"], entry="async")
    assert (mine.off_policy_correction, mine.m2_threshold) == ("custom", 0.1)
    assert parse_args([*BASE, *fully], entry="async").m2_threshold is None  # tis, the default, has none


def test_every_modes_ab_arm_runs_that_mode_and_every_backend_row_resolves():
    """The tables are data naming code: each mode's `vime bench ab` words give that mode, and
    each backend's client and placement import (a typo would otherwise surface mid-run)."""
    from vime.ab import arm_command
    from vime.backends import BACKENDS, _load
    from vime.backends.client import EngineClient
    from vime.modes import MODES

    for name in MODES:
        words = arm_command(name, 3)
        entry = {"train": "sync", "train-async": "async"}[words[0]]
        assert parse_args([*BASE, *words[1:]], entry=entry).mode == name, words
    assert arm_command("decoupled", 3)[-2:] == ["--max-staleness", "3"]
    for b in BACKENDS.values():
        assert isinstance(b.make_client("http://127.0.0.1:1", "k"), EngineClient) and callable(_load(b.place))
        assert b.ray_place is None or callable(_load(b.ray_place))  # importable without ray: it is imported when used
        assert set(b.transports) <= set(BACKENDS["vime"].transports) and "auto" in b.transports


def test_an_unknown_value_in_yaml_is_named_before_any_check_that_assumes_a_known_one(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"weight_transport": "pigeon", "rollout_backend": "vllm"}))
    with pytest.raises(ConfigError, match=r"^--weight-transport 'pigeon': use one of auto, shm"):
        parse_args([*BASE, "--config", str(cfg)])


def test_a_runs_config_yaml_reads_back_as_the_same_settings(tmp_path):
    """config.yaml holds the derived values too; read back with --config they are derived again."""
    import yaml

    args = parse_args([*BASE, "--max-staleness", "1"], entry="async")
    args.model_dir = "/somewhere"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(args.to_dict()))
    again = parse_args(["--config", str(tmp_path / "config.yaml")], entry="async")
    assert again.to_dict() == {**args.to_dict(), "model_dir": None}


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout_batchsize: 4\n")
    with pytest.raises(ConfigError, match="did you mean rollout-batch-size"):
        parse_args(["--config", str(cfg), *BASE])


def test_yaml_values_are_checked_against_the_choices_too(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("tis_mode: clip\n")
    with pytest.raises(ConfigError, match="--tis-mode 'clip': use one of truncate, mask"):
        parse_args(["--config", str(cfg), *BASE])


@pytest.mark.parametrize(
    "text, said",
    [
        ("rollout_batch_size: 4.7\n", "--rollout-batch-size: cannot read 4.7 as a whole number"),
        ("num_rollout: true\n", "--num-rollout: cannot read True as a whole number"),
        ("lr: false\n", "--lr: cannot read False as a number"),
        ("save: true\n", "--save: cannot read True as text \\(quote it in a YAML file\\)"),
        ("run_name: [a, b]\n", "--run-name: cannot read \\['a', 'b'\\] as text"),
        ("colocate: 2\n", "--colocate: cannot read 2 as true or false"),
        ("rollout_stop: true\n", "--rollout-stop: cannot read True as a JSON list"),
        ("lr: 1.0e-6\nrollout_batch_size: 4\nlr: 1.0e-5\n", "'lr' is given twice \\(lines 1 and 3\\): keep one"),
        (
            "rollout-batch-size: 4\nrollout_batch_size: 8\n",
            "'rollout-batch-size' and 'rollout_batch_size' are one flag",
        ),
        (b"run_name: caf\xe9\n", "is not UTF-8 text \\(invalid continuation byte at byte 13\\): save it as UTF-8"),
        # null reached the checks as None, where `lr < 0` raised a TypeError
        (
            "lr: null\n",
            "--lr: null is no value for it: give a number, or leave the key out for its default \\(1e-06\\)",
        ),
        ("apply_chat_template: null\n", "--apply-chat-template: null is no value for it: give true or false"),
    ],
)
def test_a_yaml_value_is_read_as_the_command_line_would_read_it(tmp_path, text, said):
    """A YAML file's typed values used to go through int()/str() unchecked (4.7 became 4, true
    became the path "True"), a key given twice kept its last value, and bytes that are not UTF-8
    ended in a traceback; each is now one line naming the key."""
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=said) as e:
        parse_args(["--config", str(cfg), *BASE])
    assert "\n" not in str(e.value)


def test_a_yaml_value_the_command_line_would_take_is_taken(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text('rollout_batch_size: 4.0\nrun_name: 7\nlr: "1e-5"\ncolocate: "yes"\nnum_rollout: "3"\n')
    args = parse_args(["--config", str(cfg), "--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl"])
    assert (args.rollout_batch_size, args.run_name, args.lr, args.colocate, args.num_rollout) == (4, "7", 1e-5, True, 3)
    cfg.write_text("eps_clip_high: null\nnum_rollout: 2\n")  # null for a setting that may be unset: its "not set"
    args = parse_args(["--config", str(cfg), "--hf-checkpoint", "tiny", "--prompt-data", "x.jsonl"])
    assert args.eps_clip_high == args.eps_clip


def test_required_flags():
    with pytest.raises(ConfigError, match="--hf-checkpoint is required"):
        parse_args(["--prompt-data", "x", "--num-rollout", "1"])
    with pytest.raises(ConfigError, match="--num-rollout"):
        parse_args(["--hf-checkpoint", "tiny", "--prompt-data", "x"])


def test_help_explains_every_flag():
    out = run_cli("train.py", "--help", timeout=60)
    assert out.returncode == 0
    for flag in [
        "--rollout-batch-size",
        "--n-samples-per-prompt",
        "--global-batch-size",
        "--eps-clip-high",
        "--apply-chat-template-kwargs",
        "--max-staleness",
    ]:
        assert flag in out.stdout
    assert "GRPO group size" in out.stdout


def test_cli_reports_config_error_as_one_line():
    out = run_cli("train.py", *BASE, "--global-batch-size", "3", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: ") and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "entry, extra, chosen, use_tis, band",
    [
        ("sync", [], "none", False, None),  # sync is unchanged: nothing is stale
        ("async", [], ASYNC_CORRECTION, True, None),  # one-step-off
        ("async", ["--rollout-function-path", FULLY_ASYNC_FN], ASYNC_CORRECTION, True, None),
        ("async", ["--max-staleness", "2"], ASYNC_CORRECTION, True, None),  # decoupled
        ("async", ["--max-staleness", "0"], "none", False, None),  # trains what sync trains
        ("async", ["--use-rollout-logprobs"], "none", False, None),  # coupled PPO is its own choice
        ("async", ["--off-policy-correction", "none"], "none", False, None),  # the old behaviour, one flag away
        ("async", ["--use-tis", "--tis-clip", "3"], "custom", True, ("truncate", 0.0, 3.0)),  # slime's flags as given
        ("sync", ["--off-policy-correction", "tis"], "tis", True, ("truncate", 0.0, 2.0)),
        ("async", ["--off-policy-correction", "icepop"], "icepop", True, ("mask", 0.5, 5.0)),
        ("async", ["--off-policy-correction", "decoupled-ppo"], "decoupled-ppo", True, ("mask", 0.0, 5.0)),
    ],
)
def test_off_policy_correction_is_resolved_and_recorded(tmp_path, entry, extra, chosen, use_tis, band):
    args = parse_args([*BASE, *extra], entry=entry)
    assert args.off_policy_correction == chosen  # what config.yaml records: never "auto"
    assert args.use_tis is use_tis
    if band is not None:
        assert (args.tis_mode, args.tis_clip_low, args.tis_clip) == band
    line = args.correction_summary()
    assert line.startswith(f"off-policy correction: {chosen}" if use_tis else "off-policy correction: none")
    # a run's own config.yaml, given back as --config, resolves to the same settings
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({k: v for k, v in args.to_dict().items() if k != "mode" and v is not None}))
    again = parse_args(["--config", str(saved)], entry=entry)
    assert (again.off_policy_correction, again.use_tis, again.tis_mode, again.tis_clip) == (
        args.off_policy_correction,
        args.use_tis,
        args.tis_mode,
        args.tis_clip,
    )


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            ["--off-policy-correction", "tis", "--tis-clip", "3"],
            "--tis-clip 3.0 contradicts --off-policy-correction tis",
        ),
        (["--off-policy-correction", "none", "--use-tis"], "--use-tis True contradicts --off-policy-correction none"),
        (["--off-policy-correction", "icepop", "--use-rollout-logprobs"], "drop one"),
    ],
)
def test_off_policy_correction_conflicts_fail_with_one_line(extra, fragment):
    with pytest.raises(ConfigError) as e:
        parse_args([*BASE, *extra], entry="async")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_over_sampling_is_refused_where_the_fully_async_worker_would_ignore_it():
    ds = ["--dynamic-sampling-filter-path", "vime.rollout.filters.check_reward_nonzero_std"]
    assert parse_args([*BASE, *ds, "--over-sampling-batch-size", "16"], entry="async").over_sampling_batch_size == 16
    for extra in (["--rollout-function-path", FULLY_ASYNC_FN], ["--max-staleness", "1"]):
        with pytest.raises(ConfigError, match="keeps --rollout-concurrency groups in flight instead"):
            parse_args([*BASE, *ds, "--over-sampling-batch-size", "16", *extra], entry="async")


def test_launcher_ray_without_ray_or_a_cluster_is_one_line(monkeypatch):
    """Where ray is missing (this environment), or no cluster answers, --launcher ray says what to do."""
    from importlib.util import find_spec

    from vime.launch.ray import join_cluster

    if find_spec("ray") is None:
        with pytest.raises(ConfigError, match=r"--launcher ray needs ray in this environment: pip install ray"):
            join_cluster()
        # and before anything starts: a run used to load its trainer, then fail on `import ray` with a traceback
        with pytest.raises(ConfigError, match=r"^--launcher ray needs ray in this environment: .*--launcher local$"):
            parse_args([*BASE, "--launcher", "ray"])
    else:  # make test-ray's environment: no cluster at this address
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
        with pytest.raises(ConfigError, match="found no Ray cluster to join") as e:
            join_cluster()
        assert "\n" not in str(e.value)


def test_a_backend_row_without_a_ray_placement_is_never_placed_by_ray(monkeypatch):
    """A new backend's row may leave out `ray_place` (its two files and one row are enough):
    --launcher ray is then refused in one line, and --launcher auto never picks Ray for it."""
    import dataclasses

    from vime.backends import BACKENDS
    from vime.launch.launcher import launcher_for
    from vime.launch.ray import RayLauncher

    row = {k: v for k, v in dataclasses.asdict(BACKENDS["vime"]).items() if k != "ray_place"}
    monkeypatch.setitem(BACKENDS, "vime", type(BACKENDS["vime"])(**row))  # as a row without Ray would be written
    assert BACKENDS["vime"].ray_place is None
    with pytest.raises(ConfigError, match=r"^--launcher ray places engines as Ray actors, .*--launcher local$") as e:
        parse_args([*BASE, "--launcher", "ray"])
    assert "\n" not in str(e.value)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # inside a Ray job, where auto would look for a cluster
    settings = parse_args(BASE).placement
    assert not RayLauncher().chosen_by_auto(settings) and launcher_for(settings).name == "local"


def test_each_setting_is_declared_once_in_its_component_and_read_through_its_view():
    """Every flag is a field of exactly one component's settings (vime/setting.py), which is the
    field of the flat Config too; no other dataclass of vime restates settings (three or more
    fields named as flags: a copy, as the objectives' were; one or two is a name the engine or a
    transport has of its own, a device or a seed); a view is frozen and built from the fields as
    they are now (a field start-up still sets, such as num_rollout, is never read stale)."""
    import dataclasses
    import importlib
    import pkgutil

    import vime
    from vime.config import FLAGS
    from vime.config.schema import COMPONENTS, Settings

    owners = {
        name: [c.__name__ for c in COMPONENTS if name in {f.name for f in dataclasses.fields(c)}] for name in FLAGS
    }
    assert all(len(o) == 1 for o in owners.values()), {n: o for n, o in owners.items() if len(o) != 1}
    others = set()
    for mod in pkgutil.walk_packages(vime.__path__, "vime."):
        if ".compat" in mod.name or mod.name.endswith(("__main__", "cli")):
            continue
        for obj in vars(importlib.import_module(mod.name)).values():
            if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj not in COMPONENTS:
                named = [f.name for f in dataclasses.fields(obj) if f.name in FLAGS]
                if not issubclass(obj, Settings) and obj.__module__ == mod.name and len(named) >= 3:
                    others.add((obj.__name__, *named))
    assert not others, f"settings restated in other dataclasses: {sorted(others)}"
    cfg = parse_args(BASE)
    for view in (cfg.rollout, cfg.algorithm, cfg.trainer, cfg.placement, cfg.eval, cfg.output):
        for f in dataclasses.fields(view):
            assert f.type == Settings.__dataclass_fields__[f.name].type and getattr(view, f.name) == getattr(
                cfg, f.name
            )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.lr = 1.0
    cfg.num_rollout = 7
    assert cfg.rollout.num_rollout == 7


def test_a_frozen_config_builds_each_component_once_and_no_copy_keeps_them():
    import copy
    import pickle

    cfg = Config(rollout_batch_size=4)
    assert cfg.rollout is not cfg.rollout  # not frozen: built on each access, never older than the fields
    cfg.freeze()
    assert cfg.rollout is cfg.rollout and cfg.trainer is cfg.trainer
    changed = cfg.derived(rollout_batch_size=2)
    assert changed.rollout.rollout_batch_size == 2 and cfg.rollout.rollout_batch_size == 4
    for clone in (copy.copy(cfg), copy.deepcopy(cfg)):
        clone.rollout_batch_size = 3  # a copy can be changed, and its component views follow
        assert clone.rollout.rollout_batch_size == 3
    rank = pickle.loads(pickle.dumps(cfg))  # a trainer rank's copy: still frozen, its component views built anew
    assert "_views" not in rank.__dict__ and rank.rollout.rollout_batch_size == 4 and rank.rollout is rank.rollout
