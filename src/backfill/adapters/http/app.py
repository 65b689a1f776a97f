"""The FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from backfill import __version__
from backfill.adapters.http.account import router as account_router
from backfill.adapters.http.admin import router as admin_router
from backfill.adapters.http.admin_caps import router as admin_caps_router
from backfill.adapters.http.admin_views import router as admin_views_router
from backfill.adapters.http.audit import AuditTrail
from backfill.adapters.http.auth import FailureBrake, bearer, secret_matches
from backfill.adapters.http.batch_controls import router as batch_controls_router
from backfill.adapters.http.dashboard import router as dashboard_router
from backfill.adapters.http.envelope import RequestIdMiddleware, install_error_handlers
from backfill.adapters.http.estimate_routes import router as estimate_router
from backfill.adapters.http.guard import EdgeGuard
from backfill.adapters.http.openapi import document
from backfill.adapters.http.progress_routes import router as progress_router
from backfill.adapters.http.reruns import router as reruns_router
from backfill.adapters.http.results_routes import router as results_router
from backfill.adapters.http.routes import router
from backfill.adapters.http.tracing import ServerSpans
from backfill.errors import Unauthorized
from backfill.services.bundle import Services
from backfill.settings import Settings


def create_app(
    services: Services,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    *,
    settings: Settings,
) -> FastAPI:
    admin_token = settings.admin_token

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            await on_start()
        try:
            yield
        finally:
            if on_stop is not None:
                await on_stop()

    app = FastAPI(
        title="Backfill",
        version=__version__,
        description="OpenAI-compatible Batch inference service.",
        lifespan=lifespan,
        # /openapi.json describes the API; the Swagger and ReDoc pages would load their
        # scripts from a CDN into the API's origin, so they are not served.
        docs_url=None,
        redoc_url=None,
        # Served below, completed with the bodies and answers FastAPI cannot infer.
        openapi_url=None,
        # FastAPI's own telemetry (newer releases; older ones ignore the keyword) would make a
        # second server span, holding the raw path, whenever a tracer provider is installed,
        # and may add exporters from OTEL_* variables: ServerSpans is the API's one span.
        telemetry={"tracing": False, "metrics": False, "logs": False, "auto_configure": False},
    )
    app.state.services = services
    app.state.admin_token = admin_token
    install_error_handlers(app)
    brake = None
    if settings.http.auth_failure_limit > 0:
        brake = FailureBrake(settings.http.auth_failure_limit, settings.http.auth_failure_window_s)
    # Added first, so it runs inside RequestIdMiddleware and its refusals carry the request id.
    app.add_middleware(
        EdgeGuard,
        admin_token=admin_token,
        max_json_body_bytes=settings.http.max_json_body_bytes,
        brake=brake,
    )
    # Inside the request id, outside the guard: it sees every answer of a route that names an
    # audited action (the guard's own refusals come before any route, and are no action).
    app.add_middleware(AuditTrail)
    app.add_middleware(RequestIdMiddleware)
    if settings.tracing.otlp_endpoint:
        # Around the others, so the span covers the request id's and the guard's answers too.
        app.add_middleware(ServerSpans)
    # First: its fixed path /v1/batches/estimate must not be read as a batch id.
    app.include_router(estimate_router)
    app.include_router(router)
    app.include_router(results_router)
    app.include_router(progress_router)
    app.include_router(reruns_router)
    app.include_router(admin_router)
    app.include_router(account_router)
    app.include_router(admin_views_router)
    app.include_router(admin_caps_router)
    app.include_router(dashboard_router)
    # Last: its POST /v1/batches/{batch_id} must not capture another route's fixed path.
    app.include_router(batch_controls_router)

    openapi = document(app)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi())

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        if await services.operations.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": "database unreachable"}, 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        token = settings.metrics_token
        if token and not secret_matches(bearer(request.scope["headers"]), token):
            raise Unauthorized(
                "Metrics need 'Authorization: Bearer <metrics_token>'.",
                code="invalid_metrics_token",
            )
        return Response(
            await services.operations.render_metrics(),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    return app
