"""slime's plug-ins of its Megatron side (custom losses over Megatron's logits, pg-loss reducers,
Megatron hooks: examples/cispo, examples/DrGRPO) import `megatron.core` or
`slime.backends.megatron_utils.*`: start-up names that as Megatron's trainer side, which vime has
not, instead of 'No module named megatron' or a guess at vllm-project/vime's names."""

from __future__ import annotations

from conftest import run_cli

from vime.compat.dialect import _explain


def test_a_slime_custom_loss_over_megatron_is_refused_in_one_line_saying_why(tmp_path):
    res = run_cli(
        "train.py", "--config", "examples/tiny.yaml", "--num-rollout", "1", "--runs-dir", str(tmp_path),
        "--loss-type", "custom_loss", "--custom-loss-function-path", "slime_megatron_loss.clipped_is_loss",
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    says = (
        "--custom-loss-function-path 'slime_megatron_loss.clipped_is_loss' imports slime.backends.megatron_utils.loss, "
        "which vime does not have: it is Megatron-LM's trainer side, and vime trains the HF model with FSDP2"
    )
    assert says in res.stderr and "Traceback" not in res.stderr


def test_megatron_itself_and_other_slime_names_are_told_apart():
    megatron = _explain(ModuleNotFoundError("No module named 'megatron'", name="megatron"))
    assert megatron is not None and megatron.startswith("imports megatron, which vime does not have: it is Megatron")
    other = _explain(ModuleNotFoundError("No module named 'slime.utils.nothing'", name="slime.utils.nothing"))
    assert other == (
        "imports slime.utils.nothing, which vime does not have: docs/plugin-compat.md lists the slime and "
        "vllm-project/vime names vime has"
    )
