"""slime's SFT script on vime: `--rollout-function-path slime.rollout.sft_rollout.generate_rollout` is
an SFT run (with --debug-train-only, without --apply-chat-template), and each --loss-mask-type
makes the tokens and loss mask slime's MultiTurnLossMaskGenerator makes (worked by hand here on a
character-level tokenizer, so every trained character can be read back)."""

from __future__ import annotations

import json

import pytest
from conftest import train_here

from vime.compat import parse_args
from vime.models import load_tokenizer, resolve_model
from vime.rollout.data.rows import DataError
from vime.rollout.loss_masks import LossMasks
from vime.rollout.sft_rollout import ChatMasks

SLIME_FN = "slime.rollout.sft_rollout.generate_rollout"
# scripts/run-qwen3-4B-base-sft.sh's SFT_ARGS, as slime writes them (no --apply-chat-template)
SLIME_SFT = [
    "--rollout-function-path", SLIME_FN, "--input-key", "messages", "--rollout-shuffle",
    "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
    "--debug-train-only",
]  # fmt: skip

# Qwen3's way with assistant turns, in a few lines: the reasoning before </think> is kept only for
# turns after the last user message (none: after the last message), and the last turn always gets a
# <think> block (empty if none)
QWEN3_LIKE = (
    "{% set ns = namespace(last_user=messages|length - 1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% set content = m.content.split('</think>')[-1] %}"
    "{% set reasoning = m.content.split('</think>')[0].split('<think>')[-1] if '</think>' in m.content else '' %}"
    "{% if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
THINKING = [
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "<think>one and one</think>2"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
]


def trained_text(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of trained tokens."""
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


@pytest.fixture(scope="module")
def qwen3_like():
    tok = load_tokenizer(resolve_model("tiny"))
    tok.chat_template = QWEN3_LIKE
    return tok


def test_slimes_path_is_an_sft_run_with_debug_train_only_and_no_chat_template_flag(tmp_path):
    args = parse_args(
        ["--hf-checkpoint", "tiny", "--prompt-data", str(tmp_path / "d.jsonl"), *SLIME_SFT, "--num-rollout", "1"],
        entry="async",  # slime's SFT scripts start train_async.py
    )
    assert args.rollout.sft_rollout and args.debug_train_only and args.mode == "sync"
    assert args.n_samples_per_prompt == 1 and not args.apply_chat_template


def test_qwen3_renders_each_turn_as_the_last_answer_and_trains_its_think_block(qwen3_like):
    ids, mask = LossMasks(qwen3_like, "qwen3").encode(THINKING)
    # each assistant message rendered after a user turn keeps its reasoning; the empty <think>
    # block of the turn without one is trained too
    assert trained_text(qwen3_like, ids, mask) == [
        "<think>\none and one\n</think>\n\n2<|im_end|>\n",
        "<think>\n\n</think>\n\n4<|im_end|>\n",
    ]
    assert qwen3_like.decode(ids).startswith("<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n<think>")


def test_qwen_renders_each_message_alone_so_the_template_drops_an_earlier_reasoning(qwen3_like):
    ids, mask = LossMasks(qwen3_like, "qwen").encode(THINKING)
    # an assistant message alone follows no user turn: Qwen3's template writes its answer only
    assert trained_text(qwen3_like, ids, mask) == ["2<|im_end|>\n", "4<|im_end|>\n"]


def test_qwen3_5_trains_from_after_think_through_the_end_of_each_turn(qwen3_like):
    ids, mask = LossMasks(qwen3_like, "qwen3_5").encode(THINKING)
    # the whole conversation rendered once: the first turn's reasoning is gone, the last turn's
    # <think>\n is not trained and what follows it is
    assert trained_text(qwen3_like, ids, mask) == ["2<|im_end|>\n", "\n</think>\n\n4<|im_end|>\n"]
    assert (
        ids
        == qwen3_like(qwen3_like.apply_chat_template(THINKING, tokenize=False), add_special_tokens=False)["input_ids"]
    )


def test_distill_qwen_is_the_templated_first_message_then_the_last_as_raw_text():
    tok = load_tokenizer(resolve_model("tiny"))
    enc = ChatMasks(tok, {}, "d.jsonl", "distill_qwen").encode(THINKING, "row 0")
    prompt = len(enc.tokens) - enc.response_length
    assert tok.decode(enc.tokens[:prompt]) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(enc.tokens[prompt:]) == "4" and enc.loss_mask == [1]


def test_the_response_runs_from_the_first_trained_token_to_the_end_as_in_slime():
    tok = load_tokenizer(resolve_model("tiny"))
    conversation = [*THINKING[:2], {"role": "user", "content": "thanks"}]  # ends with an untrained turn
    enc = ChatMasks(tok, {}, "d.jsonl", "qwen").encode(conversation, "row 0")
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(enc.tokens) == rendered  # nothing cut after the last trained token
    last_turn = tok("<|im_start|>user\nthanks<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert enc.tokens[-len(last_turn) :] == last_turn and enc.loss_mask[-len(last_turn) :] == [0] * len(last_turn)


def test_a_rule_that_trains_nothing_of_a_row_is_one_line_naming_it():
    # SmolLM2's template writes its default system prompt before a message rendered alone; the
    # qwen3 rule (made for Qwen3's templates, which have none) cuts it from the answer's turn too
    tok = load_tokenizer(resolve_model("smollm2"))
    with pytest.raises(DataError, match="row 3: --loss-mask-type qwen3 trains no token of this conversation"):
        ChatMasks(tok, {}, "d.jsonl", "qwen3").encode(THINKING[:2], "row 3")


def test_slimes_sft_script_flags_train_a_step_without_an_engine(tmp_path, capfd):
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
        for a in range(8)
    ]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_here(
        "train_async.py", "--hf-checkpoint", "tiny", "--prompt-data", str(data), *SLIME_SFT,
        "--rollout-batch-size", "4", "--global-batch-size", "4", "--num-rollout", "2",
        "--runs-dir", str(tmp_path), "--run-name", "sft",
    )  # fmt: skip
    metrics = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["train/sft_loss"] > 0 for m in metrics)
    assert not list((tmp_path / "sft").glob("engine*.log")) and "starting engine" not in capfd.readouterr().err
