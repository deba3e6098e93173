"""SFT on RL's trainer (slime's sft_rollout + sft_loss): the mask is exactly the assistant turns
of the chat template's rendering, an SFT run with slime's flags starts no engine and lowers its
loss, an RL run starts from its checkpoint, and bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, train_here

from vime.config import ConfigError, parse_args
from vime.models import load_tokenizer, resolve_model
from vime.rollout.data.rows import DataError
from vime.rollout.sft_rollout import ChatMasks, ConversationSource

SFT_FN = "vime.rollout.sft_rollout.generate_rollout"
# slime's SFT script's flags (scripts/run-qwen3-4B-base-sft.sh), with vime's module path
SLIME_SFT = [
    "--rollout-function-path", SFT_FN, "--input-key", "messages", "--rollout-shuffle",
    "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
    "--debug-train-only",
]  # fmt: skip

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "3+4="},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "Five.", "step_loss_mask": 0},  # slime's way to leave a turn out
    {"role": "user", "content": "Really?"},
    {"role": "assistant", "content": "Four, sorry."},
]


def conversations(train: Path, out: Path) -> Path:
    """The addition task's rows as one-turn conversations: the question, then its answer."""
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    out.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["label"]}]}
            )
            + "\n"
            for r in rows
        )
    )
    return out


def trained_spans(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of trained tokens."""
    spans, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_mask_covers_exactly_the_assistant_turns_of_the_templates_rendering(model):
    tok = load_tokenizer(resolve_model(model))
    enc = ChatMasks(tok, {}, "test").encode(CONVERSATION, "row 0")
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    full = tok.encode(rendered, add_special_tokens=False)
    # the tokens are the template's rendering of the whole conversation (it ends with a trained turn)
    assert enc.tokens == full
    prompt_len = len(enc.tokens) - enc.response_length
    assert len(enc.loss_mask) == enc.response_length and enc.loss_mask[0] == 1
    # trained: each assistant turn's text and the <|im_end|> + newline that close it; not the
    # header that opens it, the system or user turns, or the turn with step_loss_mask 0
    assert trained_spans(tok, enc.tokens, [0] * prompt_len + enc.loss_mask) == [
        "Seven.<|im_end|>\n",
        "Four, sorry.<|im_end|>\n",
    ]
    # the first trained token follows the first assistant header exactly
    header = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert tok.decode(enc.tokens[:prompt_len]) == header


def test_an_sft_run_with_slimes_flags_lowers_its_loss_without_an_engine_and_rl_starts_from_it(
    tmp_path, addition_data, capfd
):
    import torch
    from safetensors.torch import load_file

    data = conversations(addition_data[0], tmp_path / "sft.jsonl")
    capfd.readouterr()
    train_here(  # the SFT and RL runs in this process, their stderr read by capfd
        "train_async.py", "--hf-checkpoint", "tiny", "--prompt-data", str(data), *SLIME_SFT,
        "--rollout-batch-size", "8", "--global-batch-size", "8", "--num-rollout", "6", "--lr", "1e-3",
        "--runs-dir", str(tmp_path), "--run-name", "sft", "--save", str(tmp_path / "ckpt"),
    )  # fmt: skip
    sft_err = capfd.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/sft_loss"] for r in rows]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert all(r["perf/actor_train_tok_per_s"] > 0 and r["train/skipped_steps"] == 0 for r in rows)
    assert not list((tmp_path / "sft").glob("engine*.log")) and "starting engine" not in sft_err
    tuned, base = (
        load_file(str(tmp_path / "ckpt" / "6" / "model.safetensors")),
        load_file(str(resolve_model("tiny") / "model.safetensors")),
    )
    assert any(not torch.equal(tuned[k], base[k]) for k in base)  # the weights moved

    # RL from the SFT model: its checkpoint is an HF directory with the chat template
    train_here(
        "train.py", "--config", "examples/tiny.yaml", "--hf-checkpoint", str(tmp_path / "ckpt" / "6"),
        "--apply-chat-template", "--num-rollout", "1", "--runs-dir", str(tmp_path), "--run-name", "rl",
    )  # fmt: skip
    assert json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
    # resuming it as an RL run would read the SFT data position into the RL data: refused
    load = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--load", str(tmp_path / "ckpt"), "--num-rollout", "8",
        "--runs-dir", str(tmp_path), "--run-name", "rl-load",
    )  # fmt: skip
    assert load.returncode == 2 and "Traceback" not in load.stderr
    assert load.stderr.strip().splitlines()[-1] == (
        f"error: --load {tmp_path / 'ckpt'}: {tmp_path / 'ckpt' / '6'} is a checkpoint of an SFT run, and this is an RL "
        f"run: start from its weights with --hf-checkpoint {tmp_path / 'ckpt' / '6'} instead"
    )


def sft_args(data: Path, *extra: str):
    return parse_args(
        ["--hf-checkpoint", "tiny", "--prompt-data", str(data), *SLIME_SFT, "--num-rollout", "1", *extra],
        entry="async",
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--loss-type", "policy_loss"], "train them with --loss-type sft_loss"),
        (["--eval-interval", "2", "--eval-prompt-data", "x.jsonl"], "starts no engine, so the run evaluates nothing"),
        (["--kl-loss-coef", "0.1"], "loads no reference model: drop --kl-loss-coef"),
        (["--n-samples-per-prompt", "2"], "SFT trains each conversation once"),
        (["--custom-rm-path", "m.f"], "--custom-rm-path acts on generated samples"),
        # distillation's term was accepted without a word, and never added to an SFT step
        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t"], "adds no teacher's term: drop --use-opd"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1"], "adds no teacher's term: drop --use-opd"),
    ],
)
def test_flags_an_sft_run_cannot_honour_are_one_line(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        sft_args(tmp_path / "d.jsonl", *extra)


def test_slimes_sft_flags_need_no_saved_rollouts_and_mean_one_sample_per_conversation(tmp_path):
    args = sft_args(tmp_path / "d.jsonl", "--rollout-batch-size", "4")
    assert args.debug_train_only and args.n_samples_per_prompt == 1 and args.global_batch_size == 4
    assert args.mode == "sync" and args.off_policy_correction == "none"
    with pytest.raises(ConfigError, match="--disable-compute-advantages-and-returns: --loss-type policy_loss"):
        parse_args(
            [
                "--hf-checkpoint",
                "tiny",
                "--prompt-data",
                "d",
                "--num-rollout",
                "1",
                "--disable-compute-advantages-and-returns",
            ]
        )


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": "3+4="}, "the input is text, and SFT trains on conversations"),
        ({"messages": [{"role": "user", "content": "3+4="}]}, "the conversation has no assistant turn"),
        ({"prompt": [{"role": "user", "content": "3+4="}]}, "has no key 'messages'"),
    ],
)
def test_bad_conversations_are_one_line_naming_the_row(tmp_path, row, message):
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    tok = load_tokenizer(resolve_model("tiny"))
    with pytest.raises(DataError, match=f"d.jsonl row 1.*{message}"):
        ConversationSource(sft_args(data), tok, max_prompt_len=100)


def test_a_conversation_too_long_for_the_model_is_refused_or_left_out(tmp_path):
    long = {"messages": [{"role": "user", "content": "1+1=" * 20}, {"role": "assistant", "content": "2"}]}
    short = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    tok = load_tokenizer(resolve_model("tiny"))
    with pytest.raises(DataError, match="row 1: the conversation is .* tokens, the model takes at most 50"):
        ConversationSource(sft_args(data), tok, max_prompt_len=49)
    source = ConversationSource(sft_args(data, "--skip-overlong-prompts"), tok, max_prompt_len=49)
    assert len(source) == 1 and source.skipped_prompts == 1 and "left out 1 of 2 conversations" in source.skipped_note


def test_a_bad_row_stops_the_run_before_anything_starts_in_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    res = run_cli(
        "train_async.py", "--hf-checkpoint", "tiny", "--prompt-data", str(data), *SLIME_SFT, "--num-rollout", "1",
        "--runs-dir", str(tmp_path), "--run-name", "bad",
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        res.stderr.strip().splitlines()[-1].startswith(f"error: {data} row 0: the conversation has no assistant turn")
    )
