"""Tracing and log format settings: tracing is off unless a collector is named, the provider
it installs, and JSON log lines."""

from __future__ import annotations

import http.server
import io
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import ClassVar

import orjson
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from pydantic import ValidationError

from backfill.adapters.engines.http1 import Http1Pool
from backfill.adapters.logs import JsonLines, current_request_id
from backfill.adapters.tracing import install, tracer_provider
from backfill.settings import Settings, TracingSettings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(("BACKFILL_", "OTEL_")):
            monkeypatch.delenv(name)
    return monkeypatch


def test_tracing_is_off_by_default_and_installs_nothing(
    clean_env: pytest.MonkeyPatch,
) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("a tracer provider was installed")

    clean_env.setattr(trace, "set_tracer_provider", refuse)
    settings = Settings()
    assert settings.tracing.otlp_endpoint is None
    assert settings.log_format == "text"
    assert install(settings.tracing) is None


def test_a_process_started_with_the_defaults_makes_no_span(tmp_path: Path) -> None:
    """In a fresh process, as ``backfill serve`` starts: no provider, every span a no-op, and
    the API has no span middleware."""
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from backfill.adapters.http.app import create_app
        from backfill.adapters.http.tracing import ServerSpans
        from backfill.adapters.tracing import install
        from backfill.runner.spans import tracer
        from backfill.settings import Settings

        settings = Settings()
        assert install(settings.tracing) is None
        assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
        span = tracer.start_span("engine.request")
        assert not span.is_recording() and not span.get_span_context().is_valid
        app = create_app(None, settings=settings)  # type: ignore[arg-type]
        assert all(m.cls is not ServerSpans for m in app.user_middleware)
        print("off")
        """
    )
    done = run_python(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "off"


def test_tracing_and_log_format_from_the_file_and_the_environment(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "backfill.toml"
    path.write_text(
        'log_format = "json"\n'
        "[tracing]\n"
        'otlp_endpoint = "http://otel-collector:4318/v1/traces"\n'
        "sample_ratio = 0.25\n"
        'headers = { authorization = "Bearer abc" }\n'
    )
    settings = Settings.from_file(path)
    assert settings.log_format == "json"
    assert settings.tracing.otlp_endpoint == "http://otel-collector:4318/v1/traces"
    assert settings.tracing.sample_ratio == 0.25
    assert settings.tracing.headers == {"authorization": "Bearer abc"}
    assert settings.tracing.service_name == "backfill"

    clean_env.setenv("BACKFILL_TRACING__OTLP_ENDPOINT", "http://jaeger:4318/v1/traces")
    clean_env.setenv("BACKFILL_TRACING__SERVICE_NAME", "backfill-worker")
    clean_env.setenv("BACKFILL_LOG_FORMAT", "text")
    settings = Settings.from_file(path)
    assert settings.tracing.otlp_endpoint == "http://jaeger:4318/v1/traces"
    assert settings.tracing.service_name == "backfill-worker"
    assert settings.log_format == "text"


@pytest.mark.parametrize(
    "values",
    [
        {"otlp_endpoint": "otel-collector:4318"},
        {"otlp_endpoint": "grpc://otel-collector:4317"},
        {"sample_ratio": 1.5},
        {"sample_ratio": -0.1},
    ],
)
def test_a_wrong_tracing_setting_is_refused(values: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TracingSettings.model_validate(values)


def test_an_empty_endpoint_leaves_tracing_off() -> None:
    assert TracingSettings(otlp_endpoint="").otlp_endpoint is None


def test_the_provider_names_the_service_and_follows_the_callers_sampling() -> None:
    exporter = InMemorySpanExporter()
    settings = TracingSettings(
        otlp_endpoint="http://localhost:4318/v1/traces", service_name="bf", sample_ratio=0.0
    )
    provider = tracer_provider(settings, SimpleSpanProcessor(exporter))
    assert provider.resource.attributes["service.name"] == "bf"
    assert isinstance(provider.sampler, ParentBased)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("dropped") as span:
        assert not span.is_recording()  # ratio 0: no trace starts here
    provider.shutdown()


def test_a_json_line_holds_the_record_and_no_context_outside_a_request() -> None:
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    handler.setFormatter(JsonLines())
    log = logging.getLogger("backfill.test_json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("engine %s is down", "sim")
        token = current_request_id.set("req_123")
        try:
            log.warning("inside")
        finally:
            current_request_id.reset(token)
    finally:
        log.removeHandler(handler)
        log.propagate = True
    outside, inside = (orjson.loads(line) for line in written.getvalue().splitlines())
    assert outside["message"] == "engine sim is down"
    assert outside["level"] == "WARNING"
    assert outside["logger"] == "backfill.test_json"
    assert "request_id" not in outside
    assert "trace_id" not in outside
    assert inside["request_id"] == "req_123"


def test_the_cli_logs_json_lines_when_asked(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import logging
        from backfill.cli.main import _logging

        _logging("info", "json")
        logging.getLogger("backfill").info("started %d", 3)
        try:
            raise ValueError("x")
        except ValueError:
            logging.getLogger("backfill").exception("failed")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    started, failed = (orjson.loads(line) for line in done.stderr.splitlines())
    assert started["message"] == "started 3"
    assert started["level"] == "INFO"
    assert failed["message"] == "failed"
    assert "ValueError" in failed["exception"]


async def test_extra_headers_of_one_request_refuse_line_breaks() -> None:
    pool = Http1Pool("http://127.0.0.1:9", {}, connect_s=0.1, total_s=0.1)
    with pytest.raises(ValueError):
        await pool.post("/v1/x", b"{}", {"traceparent": "00-a\r\nX-Evil: 1"})


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP traces receiver: keeps each export's headers and spans."""

    exports: ClassVar[list[tuple[str | None, list[str], list[str]]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        names = [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        services = [
            a.value.string_value
            for rs in request.resource_spans
            for a in rs.resource.attributes
            if a.key == "service.name"
        ]
        self.exports.append((self.headers.get("authorization"), services, names))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_spans_reach_the_collector_over_otlp_http_with_the_configured_headers(
    tmp_path: Path,
) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    script = textwrap.dedent(
        f"""
        from backfill.adapters.tracing import install
        from backfill.runner.spans import tracer
        from backfill.settings import TracingSettings

        provider = install(TracingSettings(
            otlp_endpoint={endpoint!r},
            service_name="backfill-worker",
            headers={{"authorization": "Bearer collector-token"}},
        ))
        assert provider is not None
        with tracer.start_as_current_span("engine.request"):
            pass
        provider.shutdown()
        """
    )
    try:
        done = run_python(script, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    assert _Collector.exports == [
        ("Bearer collector-token", ["backfill-worker"], ["engine.request"])
    ]


def run_python(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter, without this environment's Backfill or OTel settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BACKFILL_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
