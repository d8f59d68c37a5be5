"""Observability: structlog setup (`logging`) and OpenTelemetry tracing (`tracing`)."""
