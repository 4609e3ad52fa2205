"""Checks of a model folder's files before anything reads their weights, each failure one ModelLoadError naming
the file and what is wrong with it (the model-error exit code): a safetensors header that is not one, lies
about its sizes, offsets or dtypes, or a file cut short; weights that config.json does not describe. (A GGUF's
header is checked as it is read: engine.model.gguf_header.read_header.)"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from engine.errors import ModelLoadError

# bytes per element of the safetensors dtypes (the format's own list; sub-byte floats counted in bits below)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
               "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8,
               "F64": 8, "I64": 8, "U64": 8}
DTYPE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER = 100 << 20  # the safetensors library's own limit


def safetensors_header(path: Path) -> dict:
    """The tensors a safetensors file holds ({name: {dtype, shape, data_offsets}}), checked against the file:
    raises ModelLoadError naming the file and the first thing wrong."""
    def bad(what: str) -> ModelLoadError:
        return ModelLoadError(f"{path} is not a usable safetensors file: {what}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"it has {size} bytes, fewer than its 8-byte header length (a partial download?)")
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, MAX_HEADER):
                raise bad(f"its header claims {n} bytes and the file has {size}" +
                          (" (random bytes, or cut short?)" if n > size else ""))
            text = f.read(n)
    except OSError as exc:
        raise ModelLoadError(f"{path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        header = json.loads(text)
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise bad("its header is not the JSON table of its tensors") from None
    data, spans = size - 8 - n, []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = t["dtype"], [int(s) for s in t["shape"]], t["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise bad(f"tensor {name} has no dtype, shape and data offsets") from None
        if dtype not in DTYPE_BYTES and dtype not in DTYPE_BITS:
            raise bad(f"tensor {name} has the unknown dtype {dtype!r}")
        count = math.prod(shape)
        want = count * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else -(-count * DTYPE_BITS[dtype] // 8)
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e) or min(shape, default=1) < 0:
            raise bad(f"tensor {name} has the offsets {[b, e]} and shape {shape}")
        if e > data:
            raise bad(f"tensor {name} ends at byte {e} of {data} data bytes (the file is cut short, or its header lies)")
        if e - b != want:
            raise bad(f"tensor {name} is {dtype} {shape}, {want} bytes, but its offsets span {e - b}")
        spans.append((b, e))
    at = 0
    for b, e in sorted(spans):  # the tensors tile the data, as the safetensors library requires
        if b != at:
            raise bad(f"bytes {at} to {b} of its data belong to no tensor, or to two (its header lies)")
        at = e
    if at != data:
        raise bad(f"its tensors span {at} of its {data} data bytes")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def check_folder_weights(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every safetensors file of the folder checked (safetensors_header) -> {tensor name: shape}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in safetensors_header(f).items():
            shapes[name] = tuple(int(s) for s in t["shape"])
    return shapes


def check_tensors_fit(source: str, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> None:
    """The model config.json describes (expected: {parameter: shape}) against the weights found in source:
    ModelLoadError for a parameter without a tensor, a tensor without a parameter, or a shape that differs."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(f"{source}: no tensor for {len(missing)} of the parameters config.json describes "
                             f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''})")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ModelLoadError(f"{source}: {len(extra)} tensors that config.json has no place for "
                             f"({', '.join(extra[:3])}{'...' if len(extra) > 3 else ''})")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise ModelLoadError(f"{source}: tensor {name} has the shape {list(found[name])}, config.json gives "
                                 f"{list(shape)}")


def check_folder_before_planning(folder: Path, config: dict) -> None:
    """What the planner reads of a folder, checked before it sizes anything from config.json: the safetensors
    headers, and config.json's vocab_size and hidden_size against the token embedding's shape."""
    shapes = check_folder_weights(folder)
    text = config.get("text_config") or config
    embedding = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
    if embedding is not None and "vocab_size" in text and "hidden_size" in text:
        want = (int(text["vocab_size"]), int(text["hidden_size"]))
        if tuple(shapes[embedding]) != want:
            raise ModelLoadError(f"{folder}: tensor {embedding} has the shape {list(shapes[embedding])}, config.json's "
                                 f"vocab_size and hidden_size give {list(want)}")
