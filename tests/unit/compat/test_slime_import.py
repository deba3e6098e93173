"""`import slime` outside vime's entry points: the `vime-slime.pth` file vime's wheels put in
site-packages installs the `slime.*` finder in every interpreter, without importing anything heavy,
and stands aside for a real slime. Both kinds of wheel (`pip install vime`, `pip install -e .`:
what `make install` runs) carry the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

PTH = ROOT / "vime" / "compat" / "vime-slime.pth"


def fresh_python(code: str, site_dir: Path, cwd: Path, path: str = "") -> subprocess.CompletedProcess:
    """A new interpreter with `site_dir` (holding the .pth) added as a site directory at start-up,
    as pip's site-packages is, and the worktree's vime first on the path."""
    boot = f"import site, sys; site.addsitedir({str(site_dir)!r})\n"
    env_path = ":".join(p for p in (path, str(ROOT)) if p)
    return subprocess.run(
        [sys.executable, "-c", boot + code],
        cwd=cwd,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    out = tmp_path / "site"
    out.mkdir()
    shutil.copy(PTH, out / PTH.name)
    return out


def test_a_plain_python_imports_slimes_modules_as_vimes_and_nothing_heavy_at_start_up(site_dir, tmp_path):
    out = fresh_python(
        "heavy = sorted(m for m in ('torch', 'aiohttp', 'typing', 'vime.compat.dialect') if m in sys.modules)\n"
        "import slime.rollout.sft_rollout as s, vime.rollout.sft_rollout as v\n"
        "from slime.utils.types import Sample\n"
        "from vime.rollout.types import Sample as Ours\n"
        "print(heavy, s is v, Sample is Ours)",
        site_dir,
        tmp_path,
    )
    assert out.stdout.strip() == "[] True True", out.stderr[-2000:]


def test_a_real_slime_on_the_path_is_never_shadowed(site_dir, tmp_path):
    real = tmp_path / "elsewhere"
    (real / "slime").mkdir(parents=True)
    (real / "slime" / "__init__.py").write_text("REAL = True\n")
    out = fresh_python("import slime\nprint(slime.__file__, slime.REAL)", site_dir, tmp_path, path=str(real))
    assert out.stdout.strip() == f"{real / 'slime' / '__init__.py'} True", out.stderr[-2000:]


def test_a_slime_folder_without_init_is_no_slime(site_dir, tmp_path):
    (tmp_path / "slime").mkdir()  # a clone's parent folder, in the working directory
    out = fresh_python("import slime.utils.types as t\nprint(t.__name__)", site_dir, tmp_path, path=".")
    assert out.stdout.strip() == "vime.compat.utils.types", out.stderr[-2000:]


def _tracked_copy(dst: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_both_kinds_of_wheel_put_the_pth_file_in_site_packages(tmp_path, kind):
    src = _tracked_copy(tmp_path / "src")
    hook = "build_wheel" if kind == "wheel" else "build_editable"
    build = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{hook}({str(tmp_path)!r}))"],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = tmp_path / build.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        # a regular wheel's data file for site-packages; the editable wheel's own root file
        where = "vime-0.1.0.data/purelib/vime-slime.pth" if kind == "wheel" else "vime-slime.pth"
        assert where in names, names
        assert z.read(where) == PTH.read_bytes()
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    assert f"\n{where},sha256=" in record  # pip installs it, and uninstalls it with vime
