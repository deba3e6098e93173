"""The cached test models (vime/models.py): one build when several processes ask at once, never
seen half written."""

from __future__ import annotations

import threading
import time
from pathlib import Path


def test_a_cached_model_is_built_once_by_racing_workers_and_never_seen_half_written(tmp_path):
    """Two xdist workers asking for the same cached test model: one builds it while the other
    waits, and neither sees the directory before it is whole."""
    from vime.models import build_once

    built, seen = [], []

    def build(out: Path) -> Path:
        built.append(out)
        out.mkdir(exist_ok=True)
        time.sleep(0.3)  # the other caller arrives while this one writes
        (out / "model.safetensors").write_text("weights")
        return out

    def ask() -> None:
        out = build_once(tmp_path / "m", build)
        seen.append((out / "model.safetensors").read_text())

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and seen == ["weights", "weights"] and (tmp_path / "m").is_dir()
    assert not any(p.name.startswith("m.tmp") for p in tmp_path.iterdir())
