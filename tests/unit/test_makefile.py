"""The Makefile's set-up takes torch's CPU build from a local wheel folder when it holds the wheel,
else from PyTorch's CPU wheel index, each overridable (checked on `make -n`'s commands: nothing is installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _setup_commands(tmp_path: Path, *assignments: str) -> list[str]:
    # HAS_GPU= : the CPU set-up whatever this host has; -B -n: every command printed, none run.
    out = subprocess.run(["make", "-n", "-B", "setup", "HAS_GPU=", f"VENV={tmp_path / 'venv'}", *assignments],
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    return [line for line in out.stdout.splitlines() if "pip install" in line]


def test_local_wheel_folder_is_used_when_it_holds_the_torch_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    torch_line, package_line = [c for c in _setup_commands(tmp_path, f"TORCH_WHEELS={wheels}") if "--upgrade pip" not in c]
    assert f"--find-links {wheels}" in torch_line and '"torch==2.13.0+cpu"' in torch_line
    assert "index-url" not in torch_line
    assert f"--find-links {wheels}" in package_line and '-e ".[cpu,test]"' in package_line


def test_pytorch_cpu_index_without_the_local_wheel_and_overrides(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    (empty / "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")  # another version: not it
    torch_line, package_line = [c for c in _setup_commands(tmp_path, f"TORCH_WHEELS={empty}") if "--upgrade pip" not in c]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch_line and '"torch==2.13.0+cpu"' in torch_line
    assert "--find-links" not in torch_line and "--find-links" not in package_line
    mirror = [c for c in _setup_commands(tmp_path, f"TORCH_WHEELS={empty}", "TORCH_INDEX=https://mirror.test/whl/cpu")
              if "torch==" in c]
    assert mirror and "--extra-index-url https://mirror.test/whl/cpu" in mirror[0]
    pinned = [c for c in _setup_commands(tmp_path, "TORCH_SOURCE=--find-links /srv/w", "TORCH_VERSION=2.13.1+cpu") if "torch==" in c]
    assert pinned and "--find-links /srv/w" in pinned[0] and '"torch==2.13.1+cpu"' in pinned[0]


def test_the_fast_tier_runs_the_tests_not_marked_slow_or_gpu_after_the_same_set_up(tmp_path):
    # PYTEST_ARGS= : a `make test PYTEST_ARGS=...` around this test passes its own down (MAKEFLAGS)
    out = subprocess.run(["make", "-n", "-B", "test-fast", "HAS_GPU=", f"VENV={tmp_path / 'venv'}", "PYTEST_ARGS="],
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    pytest_lines = [line for line in out if "-m pytest" in line]
    assert pytest_lines == [f"{tmp_path / 'venv'}/bin/python -m pytest -q -m \"not slow and not gpu\" "]
    assert any("pip install" in line for line in out) and any("demo-model" in line for line in out)
    # the marker exists: pytest refuses unknown ones only with --strict-markers, so check it is declared
    assert '"slow:' in (REPO / "pyproject.toml").read_text()
