"""What pyproject.toml cannot say: the editable wheel's copy of vime-slime.pth.

The .pth file installs the `slime.*` finder at interpreter start-up (vime/compat/imports.py). A
regular wheel carries it as a data file (pyproject.toml's `[tool.setuptools.data-files]`), but a
PEP 660 editable wheel (`pip install -e .`, `make install`) carries no data files, so this adds it
to the editable wheel after setuptools builds it, with its RECORD line.
"""

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "vime" / "compat" / "vime-slime.pth"


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """`wheel` rewritten with one more file at its root (site-packages, once installed)."""
    with zipfile.ZipFile(wheel) as z:
        entries = {info.filename: z.read(info) for info in z.infolist()}
    record = next(n for n in entries if n.endswith(".dist-info/RECORD"))
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    entries[record] += f"{name},sha256={digest},{len(data)}\n".encode()
    entries[name] = data
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as z:
        for entry, content in entries.items():
            z.writestr(entry, content)
    rewritten.replace(wheel)


class EditableWheelWithPth(editable_wheel):
    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob("*-0.editable-*.whl"):
            add_to_wheel(wheel, PTH.name, PTH.read_bytes())


setup(cmdclass={"editable_wheel": EditableWheelWithPth})
