"""Before a GPU script starts: can this python import what mtjax needs? One line if not.

    python3 experiments/gpu/check_env.py SCRIPT_NAME

The GPU image brings its own python and packages (no network, no venv), so the scripts
run that python with the repository on PYTHONPATH. The packages checked are the
package's own dependencies (pyproject.toml), each imported as mtjax will import it, so
a broken install counts as missing too. crc32c is not needed where numba is
(mtjax.store.checksum falls back to a numba-compiled equal; a line says so), and
tokenizers is left out: mtjax imports it only to read a tokenizer.json, which neither
script does. Exit status 1 and one line naming every missing package, or 0.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

if sys.version_info < (3, 11):  # mtjax's own floor (pyproject.toml), and tomllib's
    sys.exit(f"{sys.argv[1] if len(sys.argv) > 1 else 'check_env.py'}: {sys.executable} is Python "
             f"{sys.version.split()[0]}; mtjax needs 3.11 or later: run with PYTHON=<a newer python>")

import tomllib  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IMPORT_NAMES = {"pyyaml": "yaml"}  # distribution name -> module name where they differ
NOT_NEEDED = {"tokenizers"}


def dependencies() -> list[str]:
    """The module names of pyproject.toml's [project] dependencies."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("-", "_") for r in requirements]
    return [IMPORT_NAMES.get(n, n) for n in names if n not in NOT_NEEDED]


def missing(modules: list[str]) -> list[str]:
    """The packages of `modules` that do not import (the one actually missing where a
    package fails on another's absence)."""
    out = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            out.append((e.name or name).split(".")[0])
    return sorted(set(out))


def main(script: str) -> int:
    lacking = missing(dependencies())
    if "crc32c" in lacking and "numba" not in lacking:
        lacking.remove("crc32c")
        print(f"{script}: crc32c is not installed: the store's checksums use mtjax's numba fallback (slower)",
              file=sys.stderr)
    if lacking:
        print(f"{script}: missing python packages: {', '.join(lacking)}; install them into {sys.executable} "
              f"or run with PYTHON=<a python that has them>", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).name))
