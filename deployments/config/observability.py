"""``observability``: traces (OpenTelemetry) and metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deployments.config.common import _Strict


class TracingConfig(_Strict):
    """Where the app's OpenTelemetry spans go (see :mod:`deployments.telemetry`)."""

    exporter: Literal["none", "console", "otlp", "file"] = Field(
        default="none",
        description="none; console (each process's stdout); otlp (OTLP over HTTP to "
        "'endpoint', or the OTEL_EXPORTER_OTLP_* environment); file (JSON lines under 'path').",
    )
    endpoint: str | None = Field(
        default=None, description="OTLP HTTP traces endpoint, e.g. http://collector:4318/v1/traces."
    )
    path: str | None = Field(
        default=None, description="Folder of the file exporter (one file per process)."
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces sampled (with client_context 'parent', a client's "
        "sampled traceparent is always followed).",
    )
    client_context: Literal["link", "parent"] = Field(
        default="link",
        description="A client's W3C traceparent: 'link' (the request's trace is the server's "
        "own, sampled by sample_ratio, with a link to the client's span: a client cannot "
        "force sampling or pick the trace id); 'parent' (the request's spans join the "
        "client's trace and follow its sampled flag: for clients you trust, behind a gateway "
        "that sets the header itself).",
    )

    @model_validator(mode="after")
    def _where(self) -> TracingConfig:
        if self.exporter == "file" and not self.path:
            raise ValueError("observability.tracing.path: the file exporter needs a folder")
        return self


class ObservabilityConfig(_Strict):
    """Traces and metrics."""

    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Spans.")
