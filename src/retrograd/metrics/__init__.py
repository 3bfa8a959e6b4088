"""Metric sinks: terminal progress, metrics.jsonl, TensorBoard event files. One `log(step, dict)`
fans out to all of them; names use the slash prefixes of docs (train/, eval/, optimizer/, system/)."""
from retrograd.metrics.logger import MetricsLogger  # noqa: F401
