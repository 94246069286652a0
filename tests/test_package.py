"""Packaging contracts: tiegrad imports without torch, and the code passes ruff."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_does_not_load_torch():
    code = "import sys, tiegrad, tiegrad.ops; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_works_when_torch_is_missing():
    # A meta-path finder that refuses torch simulates an install without the extra.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('no torch here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, tiegrad\n"
        "s = tiegrad.EagerSession()\n"
        "p = tiegrad.Param(np.ones(3))\n"
        "y = (s.use(p) * s.use(p)).sum()\n"
        "g = s.backward(y)\n"
        "assert len(s.parameter_groups()) == 1\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    dirs = [d for d in ("src", "tests", "benchmarks", "examples") if (ROOT / d).exists()]
    result = subprocess.run([ruff, "check", *dirs], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
