"""`slime.utils.data.Dataset` (and `filter_long_prompt`): slime's prompt data set read by vime's
row reader, its prompts over `max_length` tokens left out, `shuffle(epoch)` in slime's order; a
rollout that trains on a Dataset of its own (tests/plugins/slime_own_dataset.py) trains."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from slime.utils.data import Dataset

from unit.compat.tiny_runs import tiny_run
from vime.models import make_tiny_tokenizer
from vime.rollout.data.rows import DataError

PROMPTS = "examples/data/addition/test.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def test_rows_become_samples_and_long_prompts_are_left_out(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    rows = [{"q": "1+2=", "a": "3", "metadata": {"k": 1}}, {"q": "11+22+33=", "a": "66"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = Dataset(path, tokenizer, None, 4, prompt_key="q", label_key="a")
    assert [(s.prompt, s.label, s.metadata) for s in kept.samples] == [("1+2=", "3", {"k": 1})]
    assert len(Dataset(path, tokenizer, None, None, prompt_key="q", label_key="a")) == 2
    with pytest.raises(DataError, match="no key 'text'"):
        Dataset(path, tokenizer, None, None)  # slime's default prompt key


def test_shuffle_gives_slimes_order_per_epoch(tokenizer):
    dataset = Dataset(PROMPTS, tokenizer, None, None, prompt_key="input", label_key="label")
    origin = [s.prompt for s in dataset.origin_samples]
    dataset.shuffle(3)
    order = list(range(len(origin)))
    random.Random(42 + 3).shuffle(order)
    assert [dataset[i].prompt for i in range(len(dataset))] == [origin[i] for i in order]


def test_multimodal_data_is_refused_in_one_line(tokenizer):
    with pytest.raises(ValueError, match="vime rolls out text prompts"):
        Dataset(PROMPTS, tokenizer, None, None, prompt_key="input", multimodal_keys={"image": "images"})


def test_a_rollout_over_a_dataset_of_its_own_trains(tmp_path):
    saved = tiny_run(tmp_path, 1, "--rollout-function-path", "slime_own_dataset.generate_rollout").samples
    own = {json.loads(line)["input"] for line in Path(PROMPTS).read_text().splitlines()}  # none is a train prompt
    assert len(saved) == 16 and all(s["prompt"] in own and isinstance(s["reward"], float) for s in saved)
