"""Errors users see. Each message is one line that names the problem; the CLI prints it without a traceback."""


class KDFlowError(Exception):
    """Base class: bad input or state the user can fix. Never retried."""


class ConfigError(KDFlowError):
    """The config is wrong: unknown key, bad type or value, missing file."""


class StoreError(KDFlowError):
    """A store in the run root is missing, incomplete, corrupt, or made from different inputs."""


class FingerprintMismatch(StoreError):
    """Two stages were made from different inputs (tokenizer, token store, teacher)."""
