"""The data tests' builders: jsonl files of rows, numbered ones, and a Config reading them."""

from __future__ import annotations

import json
from pathlib import Path

from vime.config import Config


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def numbered(path: Path, n: int = 10) -> Path:
    return write_jsonl(path, [{"input": f"q{i}", "label": str(i), "metadata": {"i": i}} for i in range(n)])


def make_args(prompt_data, **kw) -> Config:
    base = dict(
        prompt_data=str(prompt_data),
        input_key="input",
        label_key="label",
        metadata_key="metadata",
        label_format="text",
        apply_chat_template=False,
        apply_chat_template_kwargs={},
        rollout_shuffle=False,
        rollout_seed=42,
        n_samples_per_prompt=2,
    )
    return Config(**{**base, **kw})
