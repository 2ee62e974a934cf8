"""The metadata of a GGUF file (llama.cpp's format), read without loading tensors, transformers or torch.

Pre-flight checks need a GGUF teacher's architecture, vocabulary and context length in well under a second;
transformers reads them only by dequantising or converting (seconds to minutes). The file starts with
`GGUF`, a version (2 or 3), the tensor and key counts, then typed key/value pairs, little-endian; strings
are a uint64 length and UTF-8 bytes, arrays an element type, a uint64 count and the elements. Only the
keys are read (and, when asked, the tensor names that follow them); tensor data is never touched.
"""

from __future__ import annotations

import struct
from typing import IO, Any

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays of these keys are kept (the vocabulary); other arrays (merges, scores, token types) are skipped.
KEEP_ARRAYS = ("tokenizer.ggml.tokens",)
TENSOR_NAMES = "kdflow.tensor_names"  # where `read_gguf_metadata(..., tensor_names=True)` puts them
OUTPUT_TENSOR = "output.weight"  # llama.cpp's untied head; a model whose head is its embedding has none


class GGUFError(ValueError):
    """Not a GGUF file, or one this reader cannot parse."""


def _read(handle: IO[bytes], size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise GGUFError("file ends inside its metadata")
    return data


def _string(handle: IO[bytes]) -> str:
    (length,) = struct.unpack("<Q", _read(handle, 8))
    return _read(handle, length).decode("utf-8", errors="replace")


def _skip_string(handle: IO[bytes]) -> None:
    (length,) = struct.unpack("<Q", _read(handle, 8))
    handle.seek(length, 1)


def _value(handle: IO[bytes], kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, _read(handle, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(handle)
    if kind != _ARRAY:
        raise GGUFError(f"unknown value type {kind}")
    element, count = struct.unpack("<IQ", _read(handle, 12))
    if element in _SCALARS:
        size = struct.calcsize(_SCALARS[element])
        if not keep:
            handle.seek(size * count, 1)
            return count
        return list(struct.unpack(f"<{count}{_SCALARS[element][1]}", _read(handle, size * count)))
    if element == _STRING:
        if not keep:
            for _ in range(count):
                _skip_string(handle)
            return count
        return [_string(handle) for _ in range(count)]
    if not keep:
        for _ in range(count):
            _value(handle, element, False)
        return count
    return [_value(handle, element, True) for _ in range(count)]


def read_gguf_metadata(path: str, keep_arrays: tuple[str, ...] = KEEP_ARRAYS,
                       tensor_names: bool = False) -> dict[str, Any]:
    """Key -> value of a GGUF file's metadata; arrays not in `keep_arrays` become their length. With
    `tensor_names`, also the names of its tensors (from the tensor infos after the keys), under TENSOR_NAMES."""
    with open(path, "rb") as raw:
        handle: IO[bytes] = raw
        if _read(handle, 4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file")
        version, tensors, keys = struct.unpack("<IQQ", _read(handle, 20))
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        metadata: dict[str, Any] = {}
        for _ in range(keys):
            key = _string(handle)
            (kind,) = struct.unpack("<I", _read(handle, 4))
            metadata[key] = _value(handle, kind, key in keep_arrays)
        if tensor_names:
            names = []
            for _ in range(tensors):  # name, dimension count, dimensions, type, offset
                names.append(_string(handle))
                (dims,) = struct.unpack("<I", _read(handle, 4))
                handle.seek(8 * dims + 4 + 8, 1)
            metadata[TENSOR_NAMES] = names
    return metadata


def gguf_summary(metadata: dict[str, Any]) -> dict[str, Any]:
    """What the checks need: architecture, vocabulary size, context length, the vocabulary and special ids."""
    arch = metadata.get("general.architecture", "")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    specials = {name: metadata.get(f"tokenizer.ggml.{key}_token_id")
                for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    return {"architecture": arch, "vocab_size": vocab_size, "context_length": metadata.get(f"{arch}.context_length"),
            "block_count": metadata.get(f"{arch}.block_count"),
            "feed_forward_length": metadata.get(f"{arch}.feed_forward_length"),
            "head_count": metadata.get(f"{arch}.attention.head_count"),
            "head_count_kv": metadata.get(f"{arch}.attention.head_count_kv"),
            "embedding_length": metadata.get(f"{arch}.embedding_length"),
            "key_length": metadata.get(f"{arch}.attention.key_length"),
            "expert_count": metadata.get(f"{arch}.expert_count"),
            "expert_feed_forward_length": metadata.get(f"{arch}.expert_feed_forward_length"),
            "expert_shared_feed_forward_length": metadata.get(f"{arch}.expert_shared_feed_forward_length"),
            "tokens": tokens if isinstance(tokens, list) else None, "specials": specials,
            "tied": OUTPUT_TENSOR not in names if (names := metadata.get(TENSOR_NAMES)) else None}
