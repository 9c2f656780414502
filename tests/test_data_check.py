"""No silent skip (issue 30): a test that reads the benchmark data fails when the data folder is missing, naming
the path, and ``--no-data`` skips it on purpose with a summary line (conftest.py's ``benchmark_data`` fixture).
Each case runs pytest in a fresh process on one data test, with ``DPA_DATA`` pointing at a folder that does not
exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_TEST = "tests/test_evaluate.py::TestData::test_shared_files_load"  # reads the four data files, no model


def pytest_run(tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {**os.environ, "DPA_DATA": str(tmp_path / "missing"), "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", DATA_TEST, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_missing_data_fails_naming_the_path(tmp_path):
    code, out = pytest_run(tmp_path)
    assert code == 1, out[-3000:]
    assert f"benchmark data missing: DPA_DATA={tmp_path / 'missing'} is not a folder" in out, out[-3000:]
    assert "--no-data" in out and "1 error" in out


def test_no_data_skips_on_purpose_and_says_so(tmp_path):
    code, out = pytest_run(tmp_path, "--no-data")
    assert code == 0, out[-3000:]
    assert "1 skipped" in out and "1 benchmark data tests skipped because of --no-data" in out, out[-3000:]
