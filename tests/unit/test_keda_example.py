"""The KEDA example in deploy/kubernetes/keda holds together: the ScaledObject scales the
Deployment on a metric Backfill really exposes, for the model the pods serve; the headless
Service selects those pods on their port; Backfill's engine entry finds them by the Service's
name. Each check fails when one file drifts from another or from /metrics."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from backfill.metrics import Metrics
from backfill.settings import EngineSettings

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "keda"


def objects() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    found: dict[str, dict[str, Any]] = {"Kustomization": kustomization}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((EXAMPLE / resource).read_text()):
            found[doc["kind"]] = doc
    return found


def exposed_metrics() -> set[str]:
    return {metric.name for metric in Metrics().registry.collect()}


def test_the_scaled_object_scales_the_model_deployment_on_replicas_needed() -> None:
    found = objects()
    deployment, scaled = found["Deployment"], found["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (scaled["spec"]["minReplicaCount"], deployment["spec"]["replicas"]) == (0, 0)
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    names = set(re.findall(r"\b(backfill_[a-z_]+)\{", query))
    assert names == {"backfill_model_replicas_needed"}
    assert names <= exposed_metrics(), "the query names a metric /metrics does not have"
    # A missing series reads as 0, and one replica is asked per unit, from zero.
    assert query.endswith("or vector(0)")
    assert (trigger["metadata"]["threshold"], trigger["metadata"]["activationThreshold"]) == (
        "1",
        "0",
    )
    [model] = re.findall(r'model="([^"]+)"', query)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["vllm", "serve", model]


def test_backfill_finds_the_pods_by_the_headless_service_name() -> None:
    found = objects()
    service, deployment = found["Service"], found["Deployment"]
    namespace = found["Kustomization"]["namespace"]
    assert service["spec"]["clusterIP"] == "None", "a ClusterIP would hide the replicas"
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    [container] = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["port"] == ports[port["targetPort"]]
    assert container["readinessProbe"]["httpGet"]["port"] == port["targetPort"]

    [entry] = tomllib.loads((EXAMPLE / "engine.toml").read_text())["engines"]
    engine = EngineSettings(**entry)
    assert engine.discovery == "dns"
    where = urlsplit(engine.base_url)
    assert where.hostname == f"{service['metadata']['name']}.{namespace}.svc"
    assert where.port == port["port"]
    assert engine.models == [container["command"][-1]]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if "=" in arg)
    assert engine.max_concurrency == int(args["max-num-seqs"])
