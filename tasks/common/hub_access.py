"""Can a hub model or dataset be had from here? Asked by pre-flight (kdflow.tasks.preflight) before anything starts,
so that a hub id that is neither in the local cache nor reachable (an offline machine, a firewall, HF_HUB_OFFLINE)
is one line in a few seconds, not a stage failing after a minute of retries. No torch; datasets only in
`object_store_reads`, which lets a machine kept off the hub read dataset files from an object store.

The hub counts as reachable when a TCP connection to its endpoint (HF_ENDPOINT, default huggingface.co) opens within
a few seconds. Behind an HTTP proxy that cannot be told without a request, so there it always counts as reachable.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

from kdflow.schemas.config import TeacherConfig

CONNECT_TIMEOUT_S = 3.0
ANSWER_KEPT_S = 60.0  # one pre-flight asks up to four times; a long-lived worker asks again after this
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_answers: dict[tuple[str, int], tuple[float, str | None]] = {}


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached ('HF_HUB_OFFLINE is set', 'huggingface.co:443: Name or service not known'), or
    None when it can (or when a proxy is set: it might)."""
    from huggingface_hub import constants

    if _offline():
        return "HF_HUB_OFFLINE is set"
    return endpoint_unreachable(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)


def endpoint_unreachable(url: str) -> str | None:
    """'HOST:PORT: why' when no TCP connection to the URL's host opens within a few seconds, else None; behind an
    HTTP proxy, None (it might be reachable through it). Answers are kept a minute."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    endpoint = urllib.parse.urlsplit(url)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    asked, answer = _answers.get((host, port), (float("-inf"), None))
    if time.monotonic() - asked > ANSWER_KEPT_S:
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
                answer = None
        except OSError as error:
            why = error.strerror or ("timed out" if isinstance(error, TimeoutError) else type(error).__name__)
            answer = f"{host}:{port}: {why}"
        _answers[host, port] = (time.monotonic(), answer)
    return answer


def _cached_model(repo: str, filenames: tuple[str, ...], revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo, name, revision=revision), str) for name in filenames)


def _cached_dataset(repo: str) -> bool:
    """Anything of the dataset in the hub cache or in `datasets`' own cache (which names it owner___name...)."""
    from huggingface_hub import constants

    owner, _, name = repo.partition("/")
    if os.path.isdir(os.path.join(constants.HF_HUB_CACHE, f"datasets--{owner}--{name}")):
        return True
    cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
    return bool(glob.glob(os.path.join(glob.escape(cache), f"{glob.escape(owner)}___*")))


def hub_model_problem(setting: str, repo: str, revision: str | None = None,
                      filenames: tuple[str, ...] = ("config.json",)) -> str | None:
    """One line when the hub model `repo` (the value of `setting`) has none of `filenames` cached and the hub
    cannot be reached."""
    if _cached_model(repo, filenames, revision):
        return None
    why = hub_unreachable()
    if why is None:
        return None
    from huggingface_hub import constants

    return (f"{setting}={repo!r} is a hub model that is not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
            f" and the hub cannot be reached from here ({why}): download it where the hub can be reached "
            f"(hf download {repo}) into that cache, or give a local model folder (there is no folder {repo!r} in "
            f"the working directory {os.getcwd()})")


def hub_dataset_problem(repo: str) -> str | None:
    """One line when the hub dataset `repo` (dataset.path) has nothing cached and the hub cannot be reached."""
    if _cached_dataset(repo):
        return None
    why = hub_unreachable()
    if why is None:
        return None
    return (f"dataset.path={repo!r} is a hub dataset with nothing in the local cache, and the hub cannot be reached "
            f"from here ({why}): give local files (.jsonl, .json, .parquet, .csv, .tsv, .txt) or a save_to_disk "
            "folder, or download it where the hub can be reached")


def check_hub_model(setting: str, repo: str, revision: str | None = None,
                    filenames: tuple[str, ...] = ("config.json",)) -> None:
    """ConfigError (one line) when `repo`, a hub id, is neither cached nor reachable; a local folder or
    `package:` source is not asked about."""
    from kdflow.schemas.errors import ConfigError
    from kdflow.tasks.common.model_files import hub_model_id

    problem = hub_model_problem(setting, repo, revision, filenames) if hub_model_id(repo) else None
    if problem:
        raise ConfigError(problem)


def check_hub_teacher(teacher: TeacherConfig) -> None:
    check_hub_model("teacher.model", teacher.model, teacher.revision, (teacher.gguf_file or "config.json",))


_NOT_THE_HUB_LOCK = threading.Lock()
HUB_SCHEMES = ("http", "https", "hf")  # what HF_HUB_OFFLINE keeps datasets from reading; s3://, gs://... are not


@contextlib.contextmanager
def object_store_reads(files: list[str]) -> Iterator[None]:
    """`datasets` refuses every URL while HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set, an object store's too
    ("Offline mode is enabled. Tried to reach s3://..."). A machine kept off the hub may still read the user's own
    bucket: while `files` are all local paths or object-store URLs, datasets' offline flag is lifted inside this
    block (one block at a time; the flag is restored after). A file on the hub or behind http(s) keeps it set."""
    remote = [f for f in files if "://" in f]
    if not remote or any(f.split("://", 1)[0].lower() in HUB_SCHEMES for f in remote):
        yield
        return
    import datasets

    with _NOT_THE_HUB_LOCK:
        offline = datasets.config.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = False
        try:
            yield
        finally:
            datasets.config.HF_HUB_OFFLINE = offline
