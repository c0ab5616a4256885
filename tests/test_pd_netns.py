"""The multi-host path: prefill and decode in two network namespaces joined by a veth pair, so
the KV crosses a real (virtual) link between two network stacks. Skips where netns is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_MODEL
from procs import OPERATOR_KEY

NS_P, NS_D = "kvf-prefill", "kvf-decode"
IP_P, IP_D = "10.77.0.1", "10.77.0.2"


def sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = sh("ip", "netns", "add", "kvf-probe")
    sh("ip", "netns", "del", "kvf-probe")
    return probe.returncode == 0


@pytest.fixture
def namespaces():
    if not netns_available():
        pytest.skip("needs root and iproute2 network namespaces")
    for ns in (NS_P, NS_D):
        sh("ip", "netns", "del", ns)
    steps = [
        ("ip", "netns", "add", NS_P),
        ("ip", "netns", "add", NS_D),
        ("ip", "link", "add", "kvf-vp", "type", "veth", "peer", "name", "kvf-vd"),
        ("ip", "link", "set", "kvf-vp", "netns", NS_P),
        ("ip", "link", "set", "kvf-vd", "netns", NS_D),
        ("ip", "-n", NS_P, "addr", "add", f"{IP_P}/24", "dev", "kvf-vp"),
        ("ip", "-n", NS_D, "addr", "add", f"{IP_D}/24", "dev", "kvf-vd"),
        ("ip", "-n", NS_P, "link", "set", "kvf-vp", "up"),
        ("ip", "-n", NS_D, "link", "set", "kvf-vd", "up"),
        ("ip", "-n", NS_P, "link", "set", "lo", "up"),
        ("ip", "-n", NS_D, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            r = sh(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot build the veth pair here: {r.stderr.strip()}")
        yield
    finally:
        for ns in (NS_P, NS_D):
            sh("ip", "netns", "del", ns)


def in_ns(ns: str, args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "kvfence.cli", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "KVFENCE_ADMIN_API_KEY": OPERATOR_KEY},
    )


CLIENT = """
import httpx, sys, time
from kvfence.server.hop import sign_prefill
url, prefill_url = sys.argv[1], sys.argv[3]
for u in (prefill_url, url):  # both roles up (the prefill answers across the veth link)
    for _ in range(900):
        try:
            if httpx.get(u + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
r = httpx.post(url + "/v1/completions", timeout=60, headers=sign_prefill(sys.argv[4], sys.argv[2]),
               json={"model": "kvfence-tiny", "prompt": "pin: Q8vR2kLm7Tz\\npin:",
                     "max_tokens": 12, "temperature": 0, "stop": "\\n"})
print(r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
"""


def test_pd_across_two_network_namespaces(namespaces, tmp_path: Path) -> None:
    common = ["--model", str(TINY_MODEL), "--kv-pool-tokens", "8192", "--log-level", "warning"]
    prefill = in_ns(
        NS_P,
        [
            "serve",
            *common,
            "--host",
            IP_P,
            "--port",
            "8001",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "8998",
        ],
        tmp_path / "p.log",
    )
    decode = in_ns(
        NS_D,
        ["serve", *common, "--host", IP_D, "--port", "8002", "--disaggregation-mode", "decode"],
        tmp_path / "d.log",
    )
    try:
        time.sleep(0.5)
        client = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                NS_D,
                sys.executable,
                "-c",
                CLIENT,
                f"http://{IP_D}:8002",
                f"{IP_P}:8998",
                f"http://{IP_P}:8001",
                OPERATOR_KEY,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert client.returncode == 0, client.stderr + (tmp_path / "d.log").read_text()[-2000:]
        status, _, text = client.stdout.strip().partition(" ")
        assert status == "200", client.stdout + (tmp_path / "d.log").read_text()[-2000:]
        assert text.strip() == "Q8vR2kLm7Tz"
    finally:
        for proc in (prefill, decode):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
