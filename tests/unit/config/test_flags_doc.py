"""docs/flags.md is generated from the settings (vime/config/reference.py); it must be what the
code declares today, or a user reads defaults and choices that no longer hold."""

from conftest import ROOT

from vime.config.reference import markdown
from vime.config.schema import FLAGS

PAGE = ROOT / "docs" / "flags.md"


def test_the_flags_page_is_what_the_settings_declare():
    assert PAGE.read_text() == markdown(), "docs/flags.md is stale: python -m vime.config.reference > docs/flags.md"


def test_the_page_lists_every_flag_once_with_its_default():
    rows = [line for line in markdown().splitlines() if line.startswith("| `--")]
    named = [row.split("`")[1] for row in rows]
    assert sorted(named) == sorted("--" + f.replace("_", "-") for f in FLAGS)
    assert "| `--rollout-batch-size` | `" in markdown()  # a default that is a value is shown as one
