"""scripts/device_check.sh, the one prepared GPU check, runs end to end on the CPU at its tiny
size (every section ran, every exactness check passed), and a section that cannot run fails it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "scripts" / "device_check.sh"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", REPO / "scripts/device_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = mod  # its dataclasses look their module up
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_device_check_cpu_tiny_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "lines.json"
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = {line["section"]: line for line in json.loads(out.read_text())}
    for arch in ("llama", "qwen3", "qwen3_moe"):
        assert lines[f"exact {arch}"]["ok"] is True
        assert lines[f"exact {arch}"]["token_exact"] == lines[f"exact {arch}"]["prompts"]
    assert lines["1P1D tcp"]["ok"] is True
    cuda_path = lines["flex + decode buckets llama"]
    assert cuda_path["ok"] is True and cuda_path["attention"] == "flex"
    assert {1, 2, 4} <= set(cuda_path["graph_buckets"]) and cuda_path["captured"] == []
    assert lines["read-back checksums"]["ok"] is True
    for name in ("decode batch 1", "decode batch 8", "prefill", "guards"):
        assert name in lines, f"{name} did not run: {sorted(lines)}"
        assert lines[name]["ok"] is None  # goals are judged on cuda only
    assert lines["prefill"]["tokens_per_s"] > 0
    assert "NOT RUN" not in r.stdout


def test_a_section_that_cannot_run_fails_the_check(capsys) -> None:
    mod = _module()
    rep = mod.Report()
    rep.section("broken", lambda: (_ for _ in ()).throw(RuntimeError("no device")))
    assert rep.failed
    assert "FAIL broken: status=NOT RUN" in capsys.readouterr().out


def test_cuda_without_a_device_is_not_run_not_a_pass() -> None:
    mod = _module()
    if mod.torch.cuda.is_available():
        return  # a GPU host runs the real check instead
    assert mod.main(["--device", "cuda"]) == 1
