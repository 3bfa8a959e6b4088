"""The exception types a user can meet. One per domain; the CLI turns each into a clean message.

Every message names where the problem is (file, line, key) and, where one exists, the fix.
"""


class RetrogradError(Exception):
    """Base class: an error caused by the user's input or environment, printed without a traceback."""


class ConfigError(RetrogradError):
    """The run.toml (or a --set override) is malformed, has an unknown key or an invalid value."""


class DataError(RetrogradError):
    """A dataset file is missing, malformed, or a row lacks fields (messages name file:line)."""


class ModelError(RetrogradError):
    """The model path does not exist, cannot be loaded, or the built-in model cannot be fetched."""


class CheckpointError(RetrogradError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the current run."""
