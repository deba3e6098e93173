"""The trainer's checkpoints and weight files: a save that loads back and into transformers, a
crafted trainer state refused before it runs anything, an older checkpoint that still resumes,
an interrupted save that keeps the previous one, weight names as the checkpoint's keys, and the
shm/disk weight pushes writing once and cleaning up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from unit.trainer.actors import make_args, make_samples
from vime.trainer import actor as actor_mod
from vime.trainer.actor import Actor
from vime.transport.push import WeightPusher


def test_save_load_roundtrip_and_hf_loadable(tiny_model, tmp_path):
    a = Actor(make_args(), tiny_model)
    a.train_step(make_samples(2), [1.0, -1.0])
    ckpt = a.save(tmp_path / "ckpt" / "1", {"step": 1, "data_source": {"offset": 7}})
    weights = {n: t.clone() for n, t in a.model.state_dict().items()}
    opt = a.optimizer_step.optimizer.state_dict()
    rng = torch.get_rng_state()

    b = Actor(make_args(), tiny_model)
    torch.rand(3)  # move the RNG on; load must bring it back
    extra = b.load(ckpt)
    assert extra == {"step": 1, "data_source": {"offset": 7}}
    for n, t in b.model.state_dict().items():
        assert torch.equal(t, weights[n]), n
    got = b.optimizer_step.optimizer.state_dict()

    def groups(sd):  # the name-keyed round trip may turn the betas tuple into a list
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]

    assert groups(got) == groups(opt)
    for pid, st in opt["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][pid][k], v), (pid, k)
    assert torch.equal(torch.get_rng_state(), rng)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    for n, t in hf.state_dict().items():
        assert torch.equal(t, weights[n]), n
    assert (ckpt / "tokenizer.json").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1"]  # no .tmp / .old left


class _RunsCode:
    """Unpickling it makes a directory: a stand-in for whatever command a crafted file would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_a_crafted_trainer_state_is_refused_before_it_runs_anything(tiny_model, tmp_path):
    from vime.trainer.checkpoint import CheckpointError

    ckpt = Actor(make_args(), tiny_model).save(tmp_path / "ckpt" / "1", {"step": 1})
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)  # what vime writes is plain data
    marker = tmp_path / "ran"
    torch.save({**state, "extra": _RunsCode(marker)}, ckpt / "trainer_state.pt")
    with pytest.raises(
        CheckpointError, match=r"asks to run \S*mkdir when loaded; vime loads checkpoints as plain data"
    ) as e:
        Actor(make_args(), tiny_model).load(ckpt)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_a_checkpoint_of_an_older_vime_with_numpys_rng_array_still_resumes(tiny_model, tmp_path):
    import numpy as np

    ckpt = Actor(make_args(), tiny_model).save(tmp_path / "ckpt" / "1", {"step": 1})
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(5)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    torch.save({**state, "rng": {**state["rng"], "numpy": np.random.get_state()}}, ckpt / "trainer_state.pt")
    np.random.seed(6)
    assert Actor(make_args(), tiny_model).load(ckpt) == {"step": 1}
    assert np.array_equal(np.random.rand(3), expected)


def test_interrupted_save_keeps_the_previous_checkpoint(tiny_model, tmp_path, monkeypatch):
    a = Actor(make_args(), tiny_model)
    ckpt = a.save(tmp_path / "5", {"step": 5})
    saved = {n: t.clone() for n, t in a.model.state_dict().items()}
    a.train_step(make_samples(2), [1.0, -1.0])  # the weights move on

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(actor_mod.torch, "save", crash)  # dies after the weights, before trainer_state.pt
    with pytest.raises(KeyboardInterrupt):
        a.save(ckpt, {"step": 6})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5"]
    b = Actor(make_args(), tiny_model)
    assert b.load(ckpt) == {"step": 5}
    for n, t in b.model.state_dict().items():
        assert torch.equal(t, saved[n]), n


def names_in_file(model_dir: Path) -> list[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def test_named_weights_match_checkpoint_keys(actor, tiny_model, tmp_path):
    assert sorted(n for n, _ in actor.named_weights()) == names_in_file(tiny_model)
    from vime.models import make_tiny_model

    tied_dir = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    tied = Actor(make_args(), tied_dir)
    names = sorted(n for n, _ in tied.named_weights())
    assert "lm_head.weight" not in names and names == names_in_file(tied_dir)


class RecordingClient:
    """Stands in for EngineClient: records each push and reads the weights while they exist."""

    url = "recording"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def model_info(self) -> dict:
        return {"dtype": "float32"}  # a disk push is written in the engines' dtype

    def _read(self, path: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)

    def update_weights_from_tensor(self, payload: dict, timeout: float | None = None) -> dict:
        self.calls.append({**payload, "tensors": self._read(Path(payload["path"]))})
        return {"success": True}

    def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, timeout: float | None = None
    ) -> dict:
        self.calls.append(
            {
                "model_path": model_path,
                "weight_version": weight_version,
                "tensors": self._read(Path(model_path) / "model.safetensors"),
            }
        )
        return {"success": True}


@pytest.mark.parametrize("transport", ["shm", "disk", "auto"])
def test_weight_push_writes_once_and_cleans_up(actor, transport, tmp_path):
    clients = [RecordingClient(), RecordingClient()]
    pusher = WeightPusher(clients, transport=transport, tmp_dir=tmp_path / "w", check=False)  # no engine to ask
    (tmp_path / "w").mkdir(exist_ok=True)
    metrics = pusher.push(actor.named_weights(), version=3)
    expected = dict(actor.named_weights())
    assert metrics["perf/update_weights_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    for c in clients:
        (call,) = c.calls
        assert call["weight_version"] == 3
        if transport != "disk":
            assert call["transport"] == "shm"  # auto on CPU weights
        assert sorted(call["tensors"]) == sorted(expected)
        assert all(torch.equal(call["tensors"][n], t) for n, t in expected.items())
    paths = {c.calls[0].get("path") or c.calls[0]["model_path"] for c in clients}
    assert len(paths) == 1  # written once for all engines
    assert list((tmp_path / "w").iterdir()) == []  # and removed after the push
