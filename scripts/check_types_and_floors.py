"""Lint step: the import contracts (import-linter: floors one way, no import cycles, a pure
core) and the type check (mypy).

Both tools find modules by walking folders, but ``flatcake_ray.actors``, ``.transports`` and
``.cuda_ext`` live in top-level folders mapped into the package by setuptools
(``package-dir`` in pyproject.toml). So this builds a throwaway tree where the package is laid
out as it is installed (symlinks, nothing copied) and runs both tools over it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(into: Path) -> Path:
    """``into/flatcake_ray`` as installed: the package folder plus its mapped folders."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = into / "flatcake_ray"
    package.mkdir()
    for entry in (ROOT / "flatcake_ray").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in mapping["package-dir"].items():
        if name != "flatcake_ray":
            (package / name.split(".")[-1]).symlink_to(ROOT / folder)
    return into


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fc-layout-") as temp:
        tree = installed_layout(Path(temp))
        env = {**os.environ, "PYTHONPATH": str(tree), "MYPYPATH": str(tree)}
        bin_dir = Path(sys.executable).parent
        floors = subprocess.run(
            [str(bin_dir / "lint-imports"), str(ROOT / "pyproject.toml")], cwd=temp, env=env
        )
        types = subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "-p",
                "flatcake_ray",
            ],
            cwd=temp,
            env=env,
        )
    return floors.returncode or types.returncode


if __name__ == "__main__":
    sys.exit(main())
