"""Telemetry: Prometheus metrics (`metrics`, per-worker `workers`, router-side
`router`) and OpenTelemetry tracing (`tracing`). Importing this package starts nothing:
metrics are served by `metrics.exposition()` / `metrics.start_metrics_server()`, and
tracing is off until `tracing.configure_tracing()` (or a test) installs a provider."""
