"""The Kubernetes manifests in deploy/kubernetes render with kustomize, are valid objects of the
Kubernetes API (offline, against the schemas kubernetes-validate bundles), and are wired to
what Backfill really does: the probes ask the paths the API and the workers answer, the
settings and secrets reach the settings Backfill reads, the grace period covers a worker's
stop, and the alerts and the dashboard ask for metrics /metrics really exposes. Each check
fails when a manifest drifts from another or from the code."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import typer
import yaml
from prometheus_client.metrics import MetricWrapperBase
from starlette.types import Receive, Scope, Send

from backfill.adapters.http.server import server_config
from backfill.adapters.http.worker_probe import WorkerProbe
from backfill.cli.main import app as cli_app
from backfill.metrics import Metrics
from backfill.runner import notify, worker
from backfill.runner.group_commit import ResultWriter
from backfill.settings import EngineSettings, Settings
from tests.support import InProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("embedded", "scale-out")
MONITORING = DEPLOY / "components" / "monitoring"
# Validated against the schemas of this release: the oldest one the manifests need
# (policy/v1 PodDisruptionBudget, ttlSecondsAfterFinished, fsGroupChangePolicy are older).
KUBERNETES_VERSION = "1.28"
IMAGE = "ghcr.io/backfill/backfill"
# The image's user (and group): the manifests must run as it, never as root.
IMAGE_UID = 10001
# Objects of the Prometheus Operator and KEDA: not in Kubernetes' schemas, checked below.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}
# Series Prometheus makes itself rather than scrapes from /metrics.
PROMETHEUS_OWN = {"up"}
ALERTS = {
    "BackfillDown",
    "BackfillEngineDown",
    "BackfillBatchesWaitingOnEngine",
    "BackfillDeadlineAtRisk",
    "BackfillBatchesExpired",
    "BackfillNotificationsFailing",
    "BackfillStoredFileDamaged",
}
Obj = dict[str, Any]


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is not None:
        return found
    if os.environ.get("CI"):
        pytest.fail("kubectl is not installed: CI must check the Kubernetes manifests")
    pytest.skip(
        "KUBECTL NOT FOUND: the Kubernetes manifests in deploy/kubernetes are NOT checked "
        "(install kubectl, whose built-in kustomize renders them offline)"
    )


@functools.cache
def _render(directory: Path, kubectl: str) -> tuple[Obj, ...]:
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def rendered(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize`` makes of ``directory`` (a copy: tests may change it)."""
    return copy.deepcopy(list(_render(directory, kubectl())))


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    """The object of ``kind`` named ``name``, or ``name`` and the hash kustomize appends to a
    generated ConfigMap's name."""
    named = re.compile(rf"{re.escape(name)}(-[a-z0-9]{{10}})?")
    found = [o for o in objects if o["kind"] == kind and named.fullmatch(o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(object, pod spec) of every Deployment and Job."""
    for o in objects:
        if o["kind"] in ("Deployment", "Job"):
            yield o, o["spec"]["template"]["spec"]


def container(pod: Obj) -> Obj:
    [only] = pod["containers"]
    return dict(only)


def labels_of(pod_owner: Obj) -> dict[str, str]:
    return dict(pod_owner["spec"]["template"]["metadata"]["labels"])


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> list[Obj]:
    return rendered(DEPLOY / "overlays" / request.param)


@pytest.fixture
def scale_out() -> list[Obj]:
    return rendered(DEPLOY / "overlays" / "scale-out")


@pytest.fixture
def embedded() -> list[Obj]:
    return rendered(DEPLOY / "overlays" / "embedded")


# --- Valid objects ----------------------------------------------------------------------------


def check_custom(o: Obj) -> None:
    """What the API server would refuse of the CRDs' objects, or what would do nothing."""
    assert o["metadata"]["name"]
    spec = o["spec"]
    if o["kind"] in ("ServiceMonitor", "PodMonitor"):
        assert spec["selector"]["matchLabels"]
        key = "endpoints" if o["kind"] == "ServiceMonitor" else "podMetricsEndpoints"
        assert set(spec) == {"selector", key}, f"{o['kind']}: {sorted(spec)}"
        assert spec[key], f"a {o['kind']} without {key} scrapes nothing"
        for endpoint in spec[key]:
            assert set(endpoint) <= {"port", "path", "interval", "authorization"}, endpoint
            assert isinstance(endpoint["port"], str)
            assert endpoint["path"].startswith("/")
            assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
            if "authorization" in endpoint:
                assert endpoint["authorization"]["type"] == "Bearer"
                assert set(endpoint["authorization"]["credentials"]) == {"name", "key"}
    elif o["kind"] == "PrometheusRule":
        assert spec["groups"]
        for group in spec["groups"]:
            assert group["name"]
            assert group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
                assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", rule["alert"])
                assert isinstance(rule["expr"], str)
                assert rule["expr"].strip()
                assert re.fullmatch(r"\d+[smh]", rule.get("for", "0m"))
                assert rule["labels"]["severity"] in ("critical", "warning", "info")
                assert {"summary", "description"} <= set(rule["annotations"])
    elif o["kind"] == "ScaledObject":
        assert spec["scaleTargetRef"]["name"]
        assert spec["triggers"]
        for trigger in spec["triggers"]:
            assert trigger["type"]
            assert trigger["metadata"]


def validate(o: Obj) -> None:
    if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS:
        check_custom(o)
        return
    try:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        pytest.fail(f"{o['kind']} {o['metadata']['name']}: {where}: {exc.message}")


@pytest.mark.parametrize("directory", [*(f"overlays/{o}" for o in OVERLAYS), "keda"])
def test_every_object_is_valid_for_the_kubernetes_api(directory: str) -> None:
    objects = rendered(DEPLOY / directory)
    assert objects
    for o in objects:
        validate(o)


def test_the_validation_refuses_a_misspelled_field(scale_out: list[Obj]) -> None:
    # Strict schemas: a field Kubernetes does not know is an error, not silently dropped.
    deployment = one(scale_out, "Deployment", "backfill-worker")
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_each_overlay_has_the_objects_of_its_mode(
    embedded: list[Obj], scale_out: list[Obj]
) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in embedded}
    assert ("Deployment", "backfill") in kinds
    assert ("PersistentVolumeClaim", "backfill-data") in kinds
    assert not [o for o in embedded if o["kind"] in ("Job", "PodDisruptionBudget")]
    names = {o["metadata"]["name"] for o in scale_out if o["kind"] == "Deployment"}
    assert names == {"backfill-api", "backfill-worker"}
    one(scale_out, "Job", "backfill-db-upgrade")
    for objects in (embedded, scale_out):
        for kind in ("Service", "Secret", "ServiceMonitor", "PrometheusRule"):
            one(objects, kind, "backfill")
        one(objects, "PodMonitor", "backfill-worker")
        for o in objects:
            if o["kind"] != "Namespace":
                assert o["metadata"].get("namespace") == "backfill", o["metadata"]["name"]


# --- Processes --------------------------------------------------------------------------------


def cli_command(args: list[str]) -> tuple[list[str], Any]:
    """The subcommand words of ``args`` and the CLI command they name."""
    command: Any = typer.main.get_command(cli_app)
    words: list[str] = []
    for arg in args:
        subcommands = getattr(command, "commands", None)
        if arg.startswith("-") or subcommands is None:
            break
        assert arg in subcommands, f"backfill {' '.join(words)} has no command {arg}"
        command = subcommands[arg]
        words.append(arg)
    return words, command


def check_options(args: list[str]) -> list[str]:
    """The words of ``args``; fails on an option the command does not have."""
    words, command = cli_command(args)
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for arg in args[len(words) :]:
        assert arg.split("=", 1)[0] in options, f"backfill {' '.join(words)} has no {arg}"
    return words


def test_the_embedded_pod_runs_backfill_up_alone_on_its_volume(embedded: list[Obj]) -> None:
    deployment = one(embedded, "Deployment", "backfill")
    assert deployment["spec"]["replicas"] == 1, "SQLite has one writer"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "two pods would share it"
    pod = deployment["spec"]["template"]["spec"]
    main = container(pod)
    assert check_options(main["args"]) == ["up"]
    assert "--no-local-engine" in main["args"]
    # `up` takes its address and data directory from its flags, not from the settings.
    flags = dict(a.removeprefix("--").split("=", 1) for a in main["args"] if "=" in a)
    assert flags["host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert int(flags["port"]) == ports["http"]
    claim = one(embedded, "PersistentVolumeClaim", "backfill-data")
    volumes = {v["name"]: v for v in pod["volumes"]}
    [data] = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert volumes[data]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    [mount] = [m["mountPath"] for m in main["volumeMounts"] if m["name"] == data]
    assert Path(flags["data"]).is_relative_to(mount), "the data directory must be on the volume"


def test_scale_out_runs_api_and_worker_roles(scale_out: list[Obj]) -> None:
    api = container(one(scale_out, "Deployment", "backfill-api")["spec"]["template"]["spec"])
    work = container(one(scale_out, "Deployment", "backfill-worker")["spec"]["template"]["spec"])
    assert check_options(api["args"]) == ["serve"]
    assert check_options(work["args"]) == ["serve"]
    assert "--role=api" in api["args"]
    assert "--role=worker" in work["args"]


def test_the_migration_job_runs_db_upgrade_once(scale_out: list[Obj]) -> None:
    job = one(scale_out, "Job", "backfill-db-upgrade")
    pod = job["spec"]["template"]["spec"]
    main = container(pod)
    assert check_options(main["args"]) == ["db", "upgrade"]
    assert main["args"] == ["db", "upgrade"]
    assert pod["restartPolicy"] == "Never"
    api = one(scale_out, "Deployment", "backfill-api")["spec"]["template"]["spec"]
    # The same database, settings and image as the processes it migrates for.
    assert main["envFrom"] == container(api)["envFrom"]
    assert main["image"] == container(api)["image"]


PROBES = {"livenessProbe", "readinessProbe", "startupProbe"}


def test_probes_ask_the_api_its_health_and_readiness(overlay: list[Obj]) -> None:
    service = one(overlay, "Service", "backfill")
    serving = [
        (o, pod)
        for o, pod in workloads(overlay)
        if o["kind"] == "Deployment" and service["spec"]["selector"].items() <= labels_of(o).items()
    ]
    assert serving, "the Service selects no pods"
    for o, pod in workloads(overlay):
        main = container(pod)
        if o["metadata"]["name"] == "backfill-worker":
            continue  # its own port: test_workers_are_probed_on_their_own_port
        if (o, pod) not in serving:
            # The migration: no HTTP port, so no HTTP probe.
            assert "ports" not in main
            assert not PROBES & set(main)
            continue
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
        assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert main["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert "http" in ports


def test_workers_are_probed_on_their_own_port(scale_out: list[Obj]) -> None:
    main = container(one(scale_out, "Deployment", "backfill-worker")["spec"]["template"]["spec"])
    # worker.http_port: the one port, named for the PodMonitor; the API's port is not served.
    assert [p["name"] for p in main["ports"]] == ["metrics"]
    assert set(main) >= PROBES
    for probe in PROBES:
        assert main[probe]["httpGet"]["port"] == "metrics", probe
    assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert main["startupProbe"]["httpGet"]["path"] == "/healthz"
    # 503 until the worker has started and again while it stops.
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_service_leaves_the_workers_out(scale_out: list[Obj]) -> None:
    selector = one(scale_out, "Service", "backfill")["spec"]["selector"]
    worker_labels = labels_of(one(scale_out, "Deployment", "backfill-worker"))
    assert not selector.items() <= worker_labels.items()


def test_pods_run_as_the_image_user_never_root(overlay: list[Obj]) -> None:
    for o, pod in workloads(overlay):
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, o["metadata"]["name"]
        assert (context["runAsUser"], context["runAsGroup"]) == (IMAGE_UID, IMAGE_UID)
        assert context["fsGroup"] == IMAGE_UID, "the volumes must be writable by the image user"
        main = container(pod)
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        assert main["securityContext"]["capabilities"]["drop"] == ["ALL"]
        # A read-only root: whatever Backfill writes goes to a mounted volume.
        assert main["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in main["volumeMounts"]}
        assert {"/data", "/tmp"} <= mounts
        image, _, tag = main["image"].rpartition(":")
        assert image == IMAGE
        assert tag
        requests = main["resources"]["requests"]
        assert requests["cpu"]
        assert requests["memory"]
        assert main["resources"]["limits"]["memory"]


def test_the_image_is_one_kustomize_can_replace() -> None:
    base = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    assert [i["name"] for i in base["images"]] == [IMAGE]


def test_pod_disruption_budgets_select_the_scale_out_pods(scale_out: list[Obj]) -> None:
    budgets = [o for o in scale_out if o["kind"] == "PodDisruptionBudget"]
    deployments = [o for o in scale_out if o["kind"] == "Deployment"]
    covered = set()
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        selected = [d for d in deployments if selector.items() <= labels_of(d).items()]
        assert len(selected) == 1, f"{budget['metadata']['name']} selects {len(selected)}"
        [deployment] = selected
        assert selector == deployment["spec"]["selector"]["matchLabels"]
        covered.add(deployment["metadata"]["name"])
        # Never a budget that forbids every eviction: node drains must go on.
        replicas = deployment["spec"]["replicas"]
        if "minAvailable" in budget["spec"]:
            assert budget["spec"]["minAvailable"] < replicas
        else:
            assert budget["spec"]["maxUnavailable"] >= 1
    assert covered == {d["metadata"]["name"] for d in deployments}


def result_writer_stop_s() -> float:
    """How long the result writer's stop waits for its last commit (a literal in its code)."""
    found = re.search(r"wait_for\(self\._task, ([\d.]+)\)", inspect.getsource(ResultWriter.stop))
    assert found, "ResultWriter.stop no longer waits with wait_for(self._task, N): update me"
    return float(found.group(1))


async def no_app(scope: Scope, receive: Receive, send: Send) -> None:
    """An application for server_config, which only its settings are read of here."""


def test_the_grace_period_covers_a_workers_stop(embedded: list[Obj], scale_out: list[Obj]) -> None:
    # What a worker waits for on SIGTERM, in order: its loops and finalizes, the result
    # writer's last commit, the notifications under way.
    stop_s = worker._STOP_GRACE_S + result_writer_stop_s() + notify.STOP_GRACE_S
    pods = {
        "backfill-worker": one(scale_out, "Deployment", "backfill-worker"),
        "backfill": one(embedded, "Deployment", "backfill"),
    }
    # The embedded pod's HTTP server first finishes its requests.
    http_s = server_config(no_app, Settings()).timeout_graceful_shutdown or 0
    needs = {"backfill-worker": stop_s, "backfill": http_s + stop_s}
    for name, deployment in pods.items():
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # Room past the waits for closing the engines' clients, the health rows, the store.
        assert grace >= needs[name] + 10, f"{name}: {grace} s leaves no room past {needs[name]}"


# --- Settings and secrets ---------------------------------------------------------------------


def environment(objects: list[Obj], pod: Obj) -> dict[str, str]:
    """The variables the container gets from its ConfigMaps and Secrets."""
    env: dict[str, str] = {}
    for source in container(pod)["envFrom"]:
        if "configMapRef" in source:
            env |= one(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
        else:
            env |= one(objects, "Secret", source["secretRef"]["name"])["stringData"]
    assert "env" not in container(pod), "every variable comes from the ConfigMap or the Secret"
    return env


def settings_of(
    objects: list[Obj], pod: Obj, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """The settings Backfill reads in this container: the mounted file and the variables."""
    main = container(pod)
    env = environment(objects, pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {}
    for mount in main["volumeMounts"]:
        if "configMap" in volumes[mount["name"]]:
            config = one(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
            for key, text in config["data"].items():
                mounted[f"{mount['mountPath']}/{key}"] = text
    assert env["BACKFILL_CONFIG"] in mounted, "BACKFILL_CONFIG names no mounted file"
    path = tmp_path / "backfill.toml"
    path.write_text(mounted[env["BACKFILL_CONFIG"]])
    for name in list(os.environ):
        if name.startswith("BACKFILL_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("BACKFILL_CONFIG", str(path))
    return Settings()


def test_the_secret_and_settings_reach_every_process(
    scale_out: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = one(scale_out, "Secret", "backfill")["stringData"]
    for o, pod in workloads(scale_out):
        settings = settings_of(scale_out, pod, tmp_path, monkeypatch)
        name = o["metadata"]["name"]
        assert settings.database_url == secret["BACKFILL_DATABASE_URL"], name
        assert settings.database_url.startswith("postgresql://")
        assert settings.storage_url.startswith("s3://"), name
        assert settings.s3.access_key_id == secret["BACKFILL_S3__ACCESS_KEY_ID"]
        assert settings.s3.secret_access_key == secret["BACKFILL_S3__SECRET_ACCESS_KEY"]
        assert settings.s3.endpoint_url
        assert settings.s3.region
        assert settings.master_key == secret["BACKFILL_MASTER_KEY"]
        assert settings.admin_token == secret["BACKFILL_ADMIN_TOKEN"]
        assert settings.metrics_token == secret["BACKFILL_METRICS_TOKEN"]
        assert settings.local_engine is False, "a worker would start the bundled engine"
        mounts = {m["mountPath"] for m in container(pod)["volumeMounts"]}
        assert any(settings.data_dir.is_relative_to(m) for m in mounts), name
        if o["kind"] == "Deployment":
            # The probes and Prometheus reach the pod's address, on the port Backfill serves.
            assert settings.host == "0.0.0.0"
            [port] = container(pod)["ports"]
            if name == "backfill-worker":
                assert port["name"] == "metrics"
                assert settings.worker.http_port == port["containerPort"]
            else:
                assert settings.port == port["containerPort"]
                assert settings.worker.http_port is None, "an API process serves no worker port"


def test_the_embedded_pod_reads_its_secrets(
    embedded: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = one(embedded, "Secret", "backfill")["stringData"]
    [(_, pod)] = list(workloads(embedded))
    settings = settings_of(embedded, pod, tmp_path, monkeypatch)
    assert settings.master_key == secret["BACKFILL_MASTER_KEY"]
    assert settings.admin_token == secret["BACKFILL_ADMIN_TOKEN"]
    assert settings.metrics_token == secret["BACKFILL_METRICS_TOKEN"]
    assert not settings.database_url, "SQLite in the data directory"
    # `backfill admin …` run in the pod reads the settings alone: the same directory as `up`.
    flags = dict(a.removeprefix("--").split("=", 1) for a in container(pod)["args"] if "=" in a)
    assert settings.data_dir == Path(flags["data"])


def test_the_environment_overrides_what_the_image_sets(overlay: list[Obj]) -> None:
    # The image's own BACKFILL_* variables win over the settings file: each one must be set
    # again by the ConfigMap, or the file's value would be silently ignored.
    containerfile = ROOT / "Containerfile"
    text = containerfile.read_text() if containerfile.exists() else ""
    from_image = set(re.findall(r"\b(BACKFILL_[A-Z0-9_]+)=", text))
    for o, pod in workloads(overlay):
        env = environment(overlay, pod)
        assert from_image <= set(env), f"{o['metadata']['name']}: {from_image - set(env)}"


def test_the_secret_holds_placeholders_backfill_refuses(overlay: list[Obj]) -> None:
    # A Secret applied unchanged must stop Backfill at start, not run it with a known key.
    secret = one(overlay, "Secret", "backfill")["stringData"]
    assert all(name.startswith("BACKFILL_") for name in secret)
    assert all("REPLACE-ME" in value for value in secret.values())
    assert Settings(admin_token=secret["BACKFILL_ADMIN_TOKEN"]).admin_token_problem()


def test_the_engine_is_the_keda_fleet() -> None:
    config = tomllib.loads((DEPLOY / "base" / "backfill.toml").read_text())
    [entry] = tomllib.loads((DEPLOY / "keda" / "engine.toml").read_text())["engines"]
    [engine] = config["engines"]
    assert EngineSettings(**engine) == EngineSettings(**entry)
    assert set(EngineSettings(**entry).models) <= {m["id"] for m in config["models"]}


# --- Monitoring -------------------------------------------------------------------------------


def rules() -> list[Obj]:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard() -> Obj:
    loaded: Obj = json.loads((MONITORING / "backfill-dashboard.json").read_text())
    return loaded


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_prometheus_scrapes_the_api_with_the_metrics_token(overlay: list[Obj]) -> None:
    monitor = one(overlay, "ServiceMonitor", "backfill")
    service = one(overlay, "Service", "backfill")
    selected = [
        o
        for o in overlay
        if o["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()
    ]
    assert selected == [service]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    credentials = endpoint["authorization"]["credentials"]
    secret = one(overlay, "Secret", credentials["name"])
    assert credentials["key"] == "BACKFILL_METRICS_TOKEN"
    assert credentials["key"] in secret["stringData"]


def test_prometheus_scrapes_each_worker_pod_with_the_metrics_token(overlay: list[Obj]) -> None:
    monitor = one(overlay, "PodMonitor", "backfill-worker")
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        o for o in overlay if o["kind"] == "Deployment" and selector.items() <= labels_of(o).items()
    ]
    service = one(overlay, "Service", "backfill")["spec"]["selector"]
    # Never a pod behind the Service too: its counters would be scraped twice.
    assert not [o for o in selected if service.items() <= labels_of(o).items()]
    deployments = {o["metadata"]["name"] for o in overlay if o["kind"] == "Deployment"}
    # The embedded pod is scraped through the Service; scale-out's workers through this.
    expected = ["backfill-worker"] if "backfill-worker" in deployments else []
    assert [o["metadata"]["name"] for o in selected] == expected
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for o in selected:
        ports = container(o["spec"]["template"]["spec"])["ports"]
        assert endpoint["port"] in {p["name"] for p in ports}
    # The same credentials as the ServiceMonitor's: one metrics_token for every process.
    [api_endpoint] = one(overlay, "ServiceMonitor", "backfill")["spec"]["endpoints"]
    assert endpoint["authorization"] == api_endpoint["authorization"]
    assert endpoint["interval"] == api_endpoint["interval"]
    credentials = endpoint["authorization"]["credentials"]
    assert credentials["key"] in one(overlay, "Secret", credentials["name"])["stringData"]


def test_the_rules_alert_on_what_an_operator_must_act_on(overlay: list[Obj]) -> None:
    rule = one(overlay, "PrometheusRule", "backfill")
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} == ALERTS


def test_the_dashboard_is_a_grafana_configmap(overlay: list[Obj]) -> None:
    config = one(overlay, "ConfigMap", "backfill-grafana-dashboard")
    assert config["metadata"]["name"] == "backfill-grafana-dashboard", "no hash suffix"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    [(key, text)] = config["data"].items()
    assert key.endswith(".json")
    assert json.loads(text) == dashboard()
    board = dashboard()
    assert board["uid"]
    assert board["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"]
            assert panel["datasource"]["uid"] == "${datasource}"
    assert len(dashboard_exprs()) >= 10


def families(text: str) -> dict[str, str]:
    """The metric families ``/metrics`` text declares (``# TYPE`` lines, written for families
    with no sample yet too), by the name their samples carry, with their type."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))


def series(declared: dict[str, str]) -> set[str]:
    """Every series name of those families: a histogram's samples carry suffixes."""
    names = set(declared)
    for family, kind in declared.items():
        if kind == "histogram":
            names |= {family + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def label_names() -> dict[str, set[str]]:
    """Each metric's labels, by every series name it is scraped under."""
    found: dict[str, set[str]] = {}
    for metric in vars(Metrics()).values():
        if isinstance(metric, MetricWrapperBase):
            labels = set(metric._labelnames)
            name = metric._name
            for series in (name, f"{name}_total", f"{name}_sum", f"{name}_count"):
                found[series] = labels
            found[f"{name}_bucket"] = labels | {"le"}
    return found


METRIC = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")
BACKFILL = re.compile(r"\b(backfill_[a-z0-9_]+)\b")


def check_expr(expr: str, names: set[str], labels: dict[str, set[str]]) -> None:
    used = set(BACKFILL.findall(expr))
    # A selector with braces names a metric: Backfill's or Prometheus' own.
    selectors = set(METRIC.findall(expr)) - {"by", "without", "on", "ignoring"}
    assert selectors <= used | PROMETHEUS_OWN, f"unknown metric in {expr!r}"
    assert used or selectors, f"no metric in {expr!r}"
    missing = used - names
    assert not missing, f"{sorted(missing)} not exposed on /metrics: {expr!r}"
    for metric, matchers in re.findall(r"\b(backfill_[a-z0-9_]+)\{([^}]*)\}", expr):
        for label in re.findall(r"([a-z_]+)\s*[!=]~?", matchers):
            assert label in labels[metric], f"{metric} has no label {label}: {expr!r}"
    for grouping in re.findall(r"\bby \(([^)]*)\)", expr):
        for label in (g.strip() for g in grouping.split(",")):
            for metric in used:
                assert label in labels[metric], f"{metric} has no label {label}: {expr!r}"


async def test_alerts_and_dashboard_ask_for_what_metrics_exposes(backfill: InProcess) -> None:
    response = await backfill.client.get("/metrics")
    assert response.status_code == 200
    names = series(families(response.text))
    assert {"backfill_results_total", "backfill_engine_latency_seconds_bucket"} <= names
    labels = label_names()
    exprs = [r["expr"] for r in rules()] + dashboard_exprs()
    for expr in exprs:
        check_expr(expr, names, labels)


def test_a_drifted_name_is_caught() -> None:
    names = {"backfill_queue_depth"}
    labels = {"backfill_queue_depth": set[str]()}
    check_expr("max(backfill_queue_depth)", names, labels)
    with pytest.raises(AssertionError):
        check_expr("max(backfill_queue_size)", names, labels)
    with pytest.raises(AssertionError):
        check_expr("max by (model) (backfill_queue_depth)", names, labels)


async def test_the_probed_paths_answer(backfill: InProcess) -> None:
    health = await backfill.client.get("/healthz")
    assert health.status_code == 200
    ready = await backfill.client.get("/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


async def test_the_workers_probed_and_scraped_paths_answer(scale_out: list[Obj]) -> None:
    main = container(one(scale_out, "Deployment", "backfill-worker")["spec"]["template"]["spec"])
    [endpoint] = one(scale_out, "PodMonitor", "backfill-worker")["spec"]["podMetricsEndpoints"]
    paths = {main[probe]["httpGet"]["path"] for probe in PROBES} | {endpoint["path"]}

    async def render() -> bytes:
        return Metrics().render()

    probe = WorkerProbe("127.0.0.1", free_port(), render_metrics=render, metrics_token=None)
    await probe.start()
    try:
        probe.mark_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{probe.port}") as client:
            for path in sorted(paths):
                assert (await client.get(path)).status_code == 200, path
    finally:
        await probe.stop()
