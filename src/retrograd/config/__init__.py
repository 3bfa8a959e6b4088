"""Run configuration: the typed schema of run.toml, loading, --set overrides and fingerprints."""
from retrograd.config.load import load_config, RunConfig  # noqa: F401
