"""Errors users see. Each message is one line that names the problem; the CLI prints it without a traceback."""


class KDFlowError(Exception):
    """Base class: bad input or state the user can fix. Never retried."""


class ConfigError(KDFlowError):
    """The config is wrong: unknown key, bad type or value, missing file."""


class StoreError(KDFlowError):
    """A store in the run root is missing, incomplete, corrupt, or made from different inputs."""


class StoreUnreachable(StoreError):
    """The object store could not be reached (network, timeouts): no fault of the config and often brief, so a
    teacher worker that meets it is retried like one whose GPU failed; a rerun resumes."""


class FingerprintMismatch(StoreError):
    """Two stages were made from different inputs (tokenizer, token store, teacher)."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def first_paragraph(doc: str | None) -> str:
    """A module docstring's first paragraph on one line: a command's --help description."""
    return " ".join((doc or "").split("\n\n")[0].split())
