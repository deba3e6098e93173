"""Prompt loading (vime/rollout/data/rows.py, prompts.py): jsonl and parquet, row slices, bad data
named by file, row and key, the chat template and its kwargs, the common math sets by key flags,
and slime's data flags (a row's tools, eval keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unit.rollout.data_files import make_args, numbered, write_jsonl
from vime.models import make_tiny_tokenizer
from vime.rollout.data.prompts import load_eval_samples
from vime.rollout.data.rows import DataError, load_prompts
from vime.rollout.data.source import DataSource

# ---------------------------------------------------------------- loading


def test_load_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "1+1=", "a": 2, "meta": {"src": "x"}}, {"q": "2+2=", "a": 4, "meta": None}]
    chats = [{"q": [{"role": "user", "content": "hi"}], "a": "b"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    write_jsonl(tmp_path / "c.jsonl", chats)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "c.parquet")
    for ext in ["jsonl", "parquet"]:
        got = load_prompts(tmp_path / f"d.{ext}", input_key="q", label_key="a", metadata_key="meta")
        assert got == [
            {"input": "1+1=", "label": "2", "metadata": {"src": "x"}},
            {"input": "2+2=", "label": "4", "metadata": {}},
        ]
        got = load_prompts(tmp_path / f"c.{ext}", input_key="q", label_key="a")
        assert got == [{"input": [{"role": "user", "content": "hi"}], "label": "b", "metadata": {}}]


def test_row_slices(tmp_path):
    f = numbered(tmp_path / "d.jsonl")
    ids = lambda spec: [r["label"] for r in load_prompts(spec)]  # noqa: E731
    assert ids(f"{f}@[2:5]") == ["2", "3", "4"]
    assert ids(f"{f}@[:2]") == ["0", "1"]
    assert ids(f"{f}@[8:]") == ["8", "9"]
    assert ids(f"{f}@[-3:-1]") == ["7", "8"]
    assert len(ids(f"{f}@[:]")) == 10


@pytest.mark.parametrize("suffix", ["@[a:b]", "@[1:2:3]", "@[3]", "@[1:2"])
def test_bad_slice(tmp_path, suffix):
    f = numbered(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="slice"):
        load_prompts(f"{f}{suffix}")


def test_error_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl.*not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_error_unknown_extension(tmp_path):
    (tmp_path / "d.csv").write_text("input,label\n")
    with pytest.raises(DataError, match="extension '.csv'"):
        load_prompts(tmp_path / "d.csv")


def test_error_missing_key_names_key_file_row_and_keys(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "label": "1"}, {"question": "b", "label": "2"}])
    with pytest.raises(DataError) as e:
        load_prompts(f)
    msg = str(e.value)
    assert (
        "'input'" in msg and "d.jsonl" in msg and "row 1" in msg and "question, label" in msg and "--input-key" in msg
    )
    with pytest.raises(DataError, match="'answer'"):
        load_prompts(f, label_key="answer")
    assert len(load_prompts(f"{f}@[:1]")) == 1  # only rows inside the slice are checked


@pytest.mark.parametrize(
    "row, said",
    [
        # a JSON escape of half a surrogate pair: the tokenizer raised a TypeError on it mid-run
        (
            {"input": "3+4=\ud800", "label": "7"},
            r"row 0 \(line 1\): 'input' holds '\\ud800' at character 4, half of a surrogate pair, which is no text",
        ),
        (
            {"input": [{"role": "user", "content": "hi \udcff"}], "label": "7"},
            r"'input\[0\].content' holds '\\udcff' at character 3, half of a surrogate pair",
        ),
        ({"input": "1+1=", "label": "\ud800"}, r"'label' holds '\\ud800' at character 0"),
        (
            {"input": [], "label": "7"},
            r"'input' is an empty list of messages: every row needs a prompt",
        ),  # was "got list"
        (
            {"input": [{"role": "user", "content": "hi"}, {"role": "assistant"}], "label": "7"},
            r"'input'\[1\] must be a chat message \{role, content\}, got a dict of keys role",
        ),  # was "got list" too
        ({"input": [{"role": "user", "content": "hi"}, "hello"], "label": "7"}, r"'input'\[1\] .* got str"),
    ],
)
def test_a_row_that_is_no_text_or_no_conversation_is_one_line(tmp_path, row, said):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=said) as e:
        load_prompts(f)
    assert "\n" not in str(e.value)


def test_error_empty_dataset(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_prompts(tmp_path / "e.jsonl")
    with pytest.raises(DataError, match="empty after slicing"):
        load_prompts(f"{numbered(tmp_path / 'd.jsonl')}@[20:30]")


def test_error_malformed_json_names_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input": "1+1=", "label": "2"}\n\n{"input": "2+2=", "label": \n')
    with pytest.raises(DataError, match=r"d\.jsonl.*line 3"):
        load_prompts(f)


def test_error_bad_input_type(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": 5.5, "label": "1"}])
    with pytest.raises(DataError, match="a string, an integer or a list of chat messages"):
        load_prompts(f)
    # a task's number (vllm-project/vime's tau-bench prompts are indices) is its text; no label is needed
    # when nothing grades against one
    f = write_jsonl(tmp_path / "t.jsonl", [{"index": 5}])
    assert load_prompts(f, input_key="index", grader=None)[0]["input"] == "5"
    with pytest.raises(DataError, match="has no key 'label'"):
        load_prompts(f, input_key="index", grader="--rm-type math")


# ---------------------------------------------------------------- chat template


def test_chat_template_and_kwargs(tmp_path, tokenizer):
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input": "1+1=", "label": "2"},
            {"input": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "label": "x"},
        ],
    )
    ds = DataSource(
        make_args(f, apply_chat_template=True, apply_chat_template_kwargs={"enable_thinking": False}), tokenizer
    )
    plain, chat = ds.get_samples(2)
    assert plain[0].prompt == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert plain[0].tokens == tokenizer.encode(plain[0].prompt, add_special_tokens=False)
    assert chat[0].prompt.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU")
    # the tiny template ignores kwargs; a template that reads one shows they arrive
    tok = make_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    for kwargs, want in [({"enable_thinking": False}, "1+1= /no_think"), ({}, "1+1=")]:
        ds = DataSource(make_args(f, apply_chat_template=True, apply_chat_template_kwargs=kwargs), tok)
        assert ds.get_samples(1)[0][0].prompt == want


def test_chat_template_errors(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": [{"role": "user", "content": "hi"}], "label": "1"}])
    with pytest.raises(DataError, match="--apply-chat-template"):
        DataSource(make_args(f), tokenizer)  # chat messages need a template
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        DataSource(make_args(f, apply_chat_template=True), tok)


# ---------------------------------------------------------------- common math sets, by key flags

DAPO_ROWS = [  # slime's dapo-math-17k: a chat-message prompt and a plain label
    {"prompt": [{"role": "user", "content": "Solve 2x = 68. Answer: $Answer"}], "label": "34"},
    {"prompt": [{"role": "user", "content": "What is 3^4?"}], "label": "81"},
]

DAPO_ORIGINAL_ROWS = [  # BytedTsinghua-SIA/DAPO-Math-17k: the answer nested in reward_model
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "What is 3^4?"}],
        "reward_model": {"ground_truth": "81", "style": "rule"},
    },
]

GSM8K_ROWS = [
    {
        "question": "Ann has 3 pens and buys 4 more. How many pens?",
        "answer": "She has 3 + 4 = <<3+4=7>>7 pens.\n#### 7",
    },
    {
        "question": "A farm sells 1,200 eggs a day. How many in 2 days?",
        "answer": "1,200 * 2 = <<1200*2=2400>>2,400\n#### 2,400",
    },
]


def write_both(tmp_path: Path, name: str, rows: list[dict]) -> list[Path]:
    """The same rows as JSONL and as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    return [write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / f"{name}.parquet"]


def test_dapo_math_layout_by_key_flags(tmp_path, tokenizer):
    for path in write_both(tmp_path, "dapo", DAPO_ROWS):
        rows = load_prompts(path, input_key="prompt", label_key="label")
        assert rows == [{"input": r["prompt"], "label": r["label"], "metadata": {}} for r in DAPO_ROWS]
        ds = DataSource(make_args(path, input_key="prompt", apply_chat_template=True), tokenizer)
        assert (
            ds.get_samples(1)[0][0].prompt
            == "<|im_start|>user\nSolve 2x = 68. Answer: $Answer<|im_end|>\n<|im_start|>assistant\n"
        )
    for path in write_both(tmp_path, "dapo_original", DAPO_ORIGINAL_ROWS):
        assert load_prompts(path, input_key="prompt", label_key="reward_model.ground_truth")[0]["label"] == "81"
        with pytest.raises(DataError, match=r"row 0.* has no key 'reward_model\.answer'.*--label-key"):
            load_prompts(path, input_key="prompt", label_key="reward_model.answer")


def test_gsm8k_layout_by_key_flags(tmp_path):
    for path in write_both(tmp_path, "gsm8k", GSM8K_ROWS):
        rows = load_prompts(path, input_key="question", label_key="answer", label_format="gsm8k")
        assert [(r["input"], r["label"]) for r in rows] == [
            (GSM8K_ROWS[0]["question"], "7"),
            (GSM8K_ROWS[1]["question"], "2400"),
        ]
        assert (
            load_prompts(path, input_key="question", label_key="answer")[0]["label"] == GSM8K_ROWS[0]["answer"]
        )  # text: as it is
        with pytest.raises(DataError, match="has no key 'input'.*question, answer.*--input-key"):
            load_prompts(path, label_key="answer")
    bad = write_jsonl(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "no marker here"}])
    with pytest.raises(DataError) as e:
        load_prompts(bad, input_key="question", label_key="answer", label_format="gsm8k")
    msg = str(e.value)
    assert (
        "bad.jsonl row 1" in msg
        and "'answer'" in msg
        and "####" in msg
        and "--label-format gsm8k" in msg
        and "\n" not in msg
    )


# ---------------------------------------------------------------- slime's data flags


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def test_tool_key_passes_each_rows_tools_to_the_chat_template(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"input": "1+1=", "label": "2", "tools": TOOLS},
        {"input": "2+2=", "label": "4", "tools": json.dumps(TOOLS[:0])},  # JSON text, as Parquet often holds it
    ]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(
        pa.Table.from_pylist([{**r, "tools": json.dumps(TOOLS[: 1 - i])} for i, r in enumerate(rows)]),
        tmp_path / "d.parquet",
    )
    tok = make_tiny_tokenizer()
    tok.chat_template = (
        "{% if tools is defined and tools is not none %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    for data in (f, tmp_path / "d.parquet"):
        ds = DataSource(make_args(data, apply_chat_template=True, tool_key="tools", n_samples_per_prompt=1), tok)
        with_tools, without = ds.get_samples(2)
        assert (with_tools[0].prompt, without[0].prompt) == ("[add]1+1=", "[]2+2=")
        assert with_tools[0].metadata["tools"] == TOOLS  # rewards see them too, as in slime
    assert (
        DataSource(make_args(f, apply_chat_template=True), tok).get_samples(1)[0][0].prompt == "1+1="
    )  # no flag, no tools
    evals = load_eval_samples(make_args(f, apply_chat_template=True, tool_key="tools"), tok, f)
    assert evals[0].prompt == "[add]1+1="


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"input": "q", "label": "1"}, "has no key 'tools' (keys: input, label); set --tool-key"),
        ({"input": "q", "label": "1", "tools": {"name": "add"}}, "'tools' must be a list of OpenAI-style tool schemas"),
        ({"input": "q", "label": "1", "tools": ["add"]}, "'tools' must be a list of OpenAI-style tool schemas"),
        ({"input": "q", "label": "1", "tools": "not json"}, "got str; fix the row or set --tool-key"),
    ],
)
def test_tool_key_errors_name_file_row_and_flag(tmp_path, row, fragment):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "label": "0", "tools": []}, row])
    with pytest.raises(DataError) as e:
        load_prompts(f, tool_key="tools")
    msg = str(e.value)
    assert fragment in msg and "d.jsonl row 1 (line 2)" in msg and "--tool-key" in msg and "\n" not in msg


def test_eval_input_and_label_keys(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "e.jsonl", [{"problem": "p0", "answer": "a0"}, {"problem": "p1", "answer": "a1"}])
    args = make_args(None, eval_input_key="problem", eval_label_key="answer")
    samples = load_eval_samples(args, tokenizer, f)
    assert [(s.prompt, s.label) for s in samples] == [("p0", "a0"), ("p1", "a1")]
    with pytest.raises(DataError, match="no key 'input'.*--input-key"):  # default: the train keys
        load_eval_samples(make_args(None), tokenizer, f)
