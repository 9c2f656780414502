"""``python -m dpa selftest``: its checks pass on this CPU, and fail when dpa's numbers are wrong."""

from __future__ import annotations

import subprocess
import sys

import dpa
from dpa import selftest

FEW = ["llama", "gemma2", "gpt2", "olmoe"]  # RMSNorm, soft-caps, LayerNorm with biases, experts


def test_every_check_passes_on_the_cpu():
    lines = []
    assert selftest.run(["cpu"], FEW, model=False, say=lines.append)
    assert lines[-1] == f"{7 * len(FEW)} of {7 * len(FEW)} checks passed"


def test_a_wrong_score_fails_the_check(monkeypatch):
    """A DPA whose token scores are 1% off breaks completeness: the self-test must say so and return False."""
    real = dpa.attribute

    def off(*args, **kwargs):
        res = real(*args, **kwargs)
        for r in res if isinstance(res, list) else [res]:
            r.completeness_gap += 0.01 * float(r.token_scores.abs().sum())
        return res

    monkeypatch.setattr(dpa, "attribute", off)
    lines = []
    assert not selftest.run(["cpu"], ["llama"], model=False, say=lines.append)
    assert any(line.startswith("FAIL") and "completeness" in line for line in lines)


def test_the_command_refuses_what_it_cannot_check():
    out = subprocess.run([sys.executable, "-m", "dpa", "selftest", "--no-model", "--families", "llama,bert"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "unknown bert" in out.stderr
    out = subprocess.run([sys.executable, "-m", "dpa", "selftest", "--no-model", "--device", "nodevice:7"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--device nodevice:7" in out.stderr
