"""`vime data` rows ({input, label}) → SFT conversations ({messages}): the question as the user's
turn, and an answer in the form RL's grader reads (`Answer: <label>`) as the assistant's.

    python examples/sft/to_conversations.py data/addition/train.jsonl data/addition/sft.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in Path(src).read_text().splitlines() if line.strip()]
    with Path(dst).open("w") as out:
        for row in rows:
            messages = [
                {"role": "user", "content": row["input"]},
                {"role": "assistant", "content": f"Answer: {row['label']}"},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    print(f"{len(rows)} conversations written to {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
