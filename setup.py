"""The one build step pyproject.toml cannot declare: ``oscar_hf_lm_eval.pth`` at the root of the wheel, which installs
it into site-packages, where Python runs its line at start (``_oscar_hf_lm_eval.py`` says why: ``lm_eval --model
hf-oscar``). A regular wheel gets it from build_py; an editable wheel, which setuptools builds without the build
folder, gets it added after it is built."""

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "oscar_hf_lm_eval.pth"
PTH_LINE = b"import _oscar_hf_lm_eval; _oscar_hf_lm_eval.install()\n"


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        Path(self.build_lib, PTH_NAME).write_bytes(PTH_LINE)


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with the file ``name`` at its root, listed in its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            content = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                content += f"{name},sha256={digest},{len(data)}\n".encode()
            dst.writestr(item, content)
        dst.writestr(name, data)
    rewritten.replace(wheel)


class EditableWheel(editable_wheel):
    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob("*-0.editable-*.whl"):
            add_to_wheel(wheel, PTH_NAME, PTH_LINE)


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
