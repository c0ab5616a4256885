"""The `kvfence` command: a node whose pool cannot hold one context refuses to start (I7)."""

from __future__ import annotations

import subprocess
import sys

from conftest import TINY_MODEL


def test_i7_serve_refuses_a_pool_smaller_than_the_context() -> None:
    cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--model", str(TINY_MODEL),
           "--kv-pool-tokens", "4096", "--port", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "4096" in proc.stderr and "8192" in proc.stderr and "--kv-pool-tokens" in proc.stderr


def test_serve_reports_unsupported_model_cleanly(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--model", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "GPT2LMHeadModel" in proc.stderr and "Traceback" not in proc.stderr
