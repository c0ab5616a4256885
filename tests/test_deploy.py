"""deploy/: the Kubernetes manifests against the Kubernetes API schemas (offline, the schemas that
kubernetes-validate bundles) and against kvfence itself (every container's flags parse with the
command's own parser, probes name real routes, the grace period covers the drain, the memory
request covers `kvfence preflight`'s plan, the NetworkPolicy fences every worker port); and the
Grafana dashboard against the metric names the code registers."""

from __future__ import annotations

import argparse
import copy
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import REPO, TINY_MODEL
from fake_engine import FakeEngine

from kvfence.cli import build_parser
from kvfence.kv.prefix import PrefixCacheStats
from kvfence.pd.stats import PHASES, TransferStats
from kvfence.server.api import build_app
from kvfence.server.metrics import ServerMetrics
from kvfence.server.router import Role, WorkerPool, build_router_app
from kvfence.server.router.args import add_router_args
from kvfence.server.router.metrics import RouterMetrics
from kvfence.tools import preflight
from kvfence.tools.leakcheck.cli import parse_args as leakcheck_args

K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.31"  # the oldest minor still in upstream support when this was written
RUNTIME_BYTES = 1 << 30  # Python, torch and the HTTP stack beside the model and pool (measured)


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in _docs(p.name)]


def _kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in _all() if d["kind"] == kind]


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in _all() if d["kind"] in ("StatefulSet", "Deployment", "CronJob")]


def _flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


def _workers() -> list[dict[str, Any]]:
    return _kind("StatefulSet")


# ---- the schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "doc"), _all(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_manifest_is_valid_against_the_kubernetes_schema(name: str, doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_twin_the_schema_check_catches_a_misspelled_field() -> None:
    doc = copy.deepcopy(_workers()[0])
    doc["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_applies_every_manifest_but_the_secrets_example() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secrets.example.yaml"}
    assert sorted(listed) == sorted(files)


# ---- against kvfence itself ----------------------------------------------------------------------


def test_every_container_command_parses_with_kvfences_own_parsers(tmp_path: Path) -> None:
    keys = _docs("secrets.example.yaml")
    leak_keys = next(d for d in keys if d["metadata"]["name"] == "kvfence-leakcheck-keys")
    for doc in _workloads():
        (c,) = _pod(doc)["containers"]
        cmd, args = c["args"][0], c["args"][1:]
        if cmd == "serve":
            build_parser().parse_args(c["args"])
        elif cmd == "router":
            p = argparse.ArgumentParser()
            add_router_args(p)
            p.parse_args(args)
        else:
            assert cmd == "leakcheck"
            key_file = tmp_path / "keys"
            key_file.write_text(leak_keys["stringData"]["keys"])
            args = [f"--api-key-file={key_file}" if a.startswith("--api-key-file") else a
                    for a in args]
            assert len(leakcheck_args(args).tenants) == 2  # between two tenants, not one


def test_probes_name_routes_that_exist_and_mean_readiness_and_liveness() -> None:
    worker = {r.path for r in build_app(FakeEngine(), api_keys=None).routes}
    router_app = build_router_app(["http://a:1"], ["http://b:1"], api_keys=None)
    router = {r.path for r in router_app.routes}
    for doc in _workers():
        (c,) = _pod(doc)["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 while draining
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"  # 200 while draining
        assert {"/health", "/live"} <= worker
    (router_doc,) = _kind("Deployment")
    (c,) = _pod(router_doc)["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and "/health" in router
    assert "tcpSocket" in c["livenessProbe"]  # no healthy worker is not a hung router


def test_termination_grace_covers_prestop_and_the_drain() -> None:
    for doc in [*_workers(), *_kind("Deployment")]:
        pod = _pod(doc)
        (c,) = pod["containers"]
        drain = float(_flag(c["args"], "drain-timeout"))
        pre = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] >= pre + drain + 10, doc["metadata"]["name"]


def test_worker_memory_request_covers_the_preflight_plan() -> None:
    for doc in _workers():
        (c,) = _pod(doc)["containers"]
        args = c["args"]
        plan, code = preflight.run_preflight(preflight.build_parser().parse_args([
            "--model", str(TINY_MODEL),  # the image's copy of the bundled model
            "--kv-pool-tokens", _flag(args, "kv-pool-tokens"),
            "--context-length", _flag(args, "context-length"),
            "--role", _flag(args, "disaggregation-mode"),
        ]))
        assert code == 0, plan.problem()
        need = plan.model_bytes + plan.pool_bytes + plan.activation_reserve_bytes + RUNTIME_BYTES
        assert _bytes(c["resources"]["requests"]["memory"]) >= need, doc["metadata"]["name"]
        assert _bytes(c["resources"]["limits"]["memory"]) >= need


def test_router_lists_each_stateful_worker_by_its_stable_name() -> None:
    (router_doc,) = _kind("Deployment")
    (c,) = _pod(router_doc)["containers"]
    p = argparse.ArgumentParser()
    add_router_args(p)
    a = p.parse_args(c["args"][1:])
    for doc in _workers():
        role = _flag(_pod(doc)["containers"][0]["args"], "disaggregation-mode")
        name, svc = doc["metadata"]["name"], doc["spec"]["serviceName"]
        port = _flag(_pod(doc)["containers"][0]["args"], "port")
        expected = [f"http://{name}-{i}.{svc}:{port}" for i in range(doc["spec"]["replicas"])]
        assert getattr(a, role) == expected
        (service,) = [s for s in _kind("Service") if s["metadata"]["name"] == svc]
        assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod


def test_network_policy_fences_every_worker_port_to_kvfence_pods() -> None:
    (workers,) = [d for d in _kind("NetworkPolicy") if d["metadata"]["name"] == "kvfence-workers"]
    selected = set(workers["spec"]["podSelector"]["matchExpressions"][0]["values"])
    for doc in _workers():
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] in selected
    rules = workers["spec"]["ingress"]
    internal = [r for r in rules if "ports" not in r]
    # Every port (HTTP, bootstrap, Mooncake's own) is open to kvfence's components only.
    (rule,) = internal
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}
    assert set(peer["podSelector"]["matchExpressions"][0]["values"]) == {
        "router", "prefill", "decode"}
    for r in rules:
        if "ports" in r:  # anything else: the metrics port only
            assert [p["port"] for p in r["ports"]] == [30000]
            assert all("namespaceSelector" in f for f in r["from"])


def test_every_secret_a_pod_mounts_is_defined_and_every_file_flag_is_mounted() -> None:
    secrets = {d["metadata"]["name"] for d in _docs("secrets.example.yaml")}
    for doc in _workloads():
        pod = _pod(doc)
        (c,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for v in volumes.values():
            assert v["secret"]["secretName"] in secrets
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        for a in c["args"]:
            if re.match(r"--[a-z-]*-file=", a):
                path = a.split("=", 1)[1]
                assert any(path.startswith(m + "/") for m in mounts), a


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)([KMGT]i)?", quantity)
    assert m, quantity
    return int(m[1]) * units.get(m[2] or "", 1)


# ---- the Grafana dashboard -----------------------------------------------------------------------

DASHBOARD = REPO / "deploy" / "grafana" / "kvfence.json"
_METRIC = re.compile(r"\bkvfence_[a-z0-9_]+")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


class _AllMetricsEngine(FakeEngine):
    """A role whose scrape shows every family a node can export: a prefix cache's, and a PD
    worker's transfer families with every counter the PD code increments."""

    def stats(self) -> Any:
        return replace(super().stats(), prefix_cache=PrefixCacheStats(0, 0, 0, 0, 0))

    def metrics(self) -> Any:
        stats = TransferStats("decode")
        for path in (REPO / "kvfence" / "pd").rglob("*.py"):
            for name in re.findall(r"stats\.inc\(\s*\"([a-z_]+)\"", path.read_text()):
                stats.inc(name)
        for phase in PHASES:
            stats.observe_phase(phase, 0.0)
        return stats.metrics(0)


def exported_series() -> set[str]:
    """Every series name kvfence's scrapes can carry, from the registries the code builds."""
    families = [*ServerMetrics(_AllMetricsEngine()).registry.collect()]
    pools = (WorkerPool(Role.PREFILL, ["http://p:1"]), WorkerPool(Role.DECODE, ["http://d:1"]))
    families += RouterMetrics(lambda: pools).registry.collect()
    return {f.name + s for f in families for s in _SUFFIXES.get(f.type, ("",))}


def dashboard_problems(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    problems = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in _METRIC.findall(target["expr"]):
                if name not in exported:
                    problems.append(f"{panel['title']}: {name} is not exported")
    return problems


def test_every_dashboard_query_names_a_metric_the_code_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series()
    assert dashboard_problems(dashboard, exported) == []
    used = {n for p in dashboard["panels"] for t in p.get("targets", [])
            for n in _METRIC.findall(t["expr"])}
    # What the dashboard is for: TTFT, ITL, E2E, throughput, running/waiting, pool use,
    # transfers by outcome and latency, guard rejections.
    for family in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "completion_tokens_total",
                   "requests_running", "requests_waiting", "pool_pages_used",
                   "pd_transfers_committed_total", "pd_aborts_sent_total",
                   "pd_transfer_seconds_bucket", "rejections_total", "kv_integrity_errors_total",
                   "pd_checksum_mismatches_total"):
        assert f"kvfence_{family}" in used, family


def test_twin_a_renamed_metric_in_the_dashboard_is_caught() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    target = dashboard["panels"][1]["targets"][0]
    target["expr"] = target["expr"].replace("kvfence_time_to_first_token", "kvfence_ttft")
    assert dashboard_problems(dashboard, exported_series()) != []


def test_dashboard_panels_have_unique_ids_and_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job"} <= variables
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
