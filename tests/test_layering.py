"""The layering risk ← defenses ← guard ← flower (attacks beside) holds: import-linter's contracts
in pyproject.toml, run by ``lint-imports`` from this interpreter's environment.

The second test copies the package, adds one forbidden import (risk importing the guard) and
checks that the same contracts then fail — so a green first test means the contracts are read
and enforced, not skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(package_parent: Path) -> subprocess.CompletedProcess:
    """Run lint-imports with the repository's contracts, importing ``flguard`` from ``package_parent``.

    import-linter is in the dev extra (like pytest): missing, the check fails rather than skips."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} not found: pip install -c constraints.txt -e .[dev]"
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=package_parent, env=env, capture_output=True, text=True, timeout=300)


def test_contracts_are_kept():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "4 kept" in result.stdout, result.stdout


def test_a_forbidden_import_breaks_a_contract(tmp_path):
    shutil.copytree(ROOT / "flguard", tmp_path / "flguard", ignore=shutil.ignore_patterns("__pycache__"))
    closed_forms = tmp_path / "flguard" / "risk" / "closed_forms.py"
    closed_forms.write_text(closed_forms.read_text() + "\nfrom flguard.guard.report import METRIC_KEYS  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout and "flguard.risk.closed_forms -> flguard.guard.report" in result.stdout, \
        result.stdout
