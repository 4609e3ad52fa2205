"""GGUF conversion: a file's config, tokenizer and chat template written once to a cached folder keyed by
the file's identity (ensure_converted), with a pointer back to the file its weights are read from.
The config and tokenizer of the held architectures are made from the header (engine.model.gguf_config),
others by transformers' own GGUF readers.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from filelock import FileLock
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.errors import ModelLoadError
from engine.model.gguf_config import GEMMA_TOKENIZERS, Given, config_dict, gguf_tokenizer
from engine.model.gguf_header import check_architecture, held_architecture, read_header
from engine.model.sources import GGUF_POINTER
from engine.paths import cache_root

IDENTITY_HEAD = 16 << 20  # bytes hashed at the start of the file (metadata, tokenizer) and
IDENTITY_TAIL = 1 << 20  # at its end, with its size: the file's identity without reading 5 GB
CONVERSION_VERSION = 1  # bump when the converted folder's contents change


def identity(path: Path) -> str:
    """A key for the file's contents: its size and hashes of its first 16 MiB and last 1 MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(IDENTITY_HEAD))
        if size > IDENTITY_HEAD:
            f.seek(max(IDENTITY_HEAD, size - IDENTITY_TAIL))
            h.update(f.read(IDENTITY_TAIL))
    return h.hexdigest()[:20]


def converted_dir(path: Path, name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:48] or "model"
    return cache_root() / "models" / f"gguf-{safe}-{identity(path)}"


FRESH: dict[Path, object] = {}  # tokenizer backends converted in this process, by folder (take_fresh)


def take_fresh(folder: Path):
    """The tokenizer backend this process converted into folder, once (the first load then builds its tokenizer
    from it instead of parsing the tokenizer.json just written: Gemma 3's, ~1.5 s), else None."""
    backend = FRESH.pop(Path(folder), None)
    return None if backend is None else Given(backend)


def convert(path: Path, dest: Path, on_status: Callable[[str], None] | None = None) -> Path:
    """Write the GGUF's config, tokenizer and chat template to dest (temp folder, then rename), with a
    pointer back to the file the weights are read from."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if (dest / GGUF_POINTER).is_file():
            return dest  # another process finished it while we waited
        header = read_header(path)
        check_architecture(header.arch, path)
        if on_status:
            on_status(f"reading the config and tokenizer of {path.name} once into {dest}")
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
        try:
            config, tok, header = config_and_tokenizer(path, header.arch)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            tok.save_pretrained(tmp)
            fresh = tok.backend_tokenizer if header is not None and header.arch in GEMMA_TOKENIZERS else None
            pointer = {"source": str(path.resolve()), "size": path.stat().st_size, "identity": identity(path),
                       "version": CONVERSION_VERSION}
            (tmp / GGUF_POINTER).write_text(json.dumps(pointer, indent=1), encoding="utf-8")
            os.replace(tmp, dest)
            if fresh is not None:  # (the latest only: a process that converts without loading keeps one)
                FRESH.clear()
                FRESH[dest] = fresh
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def config_and_tokenizer(path: Path, arch: str):
    """The GGUF's transformers config and tokenizer, and its header read with arrays where they were made from
    it (a held architecture: gguf_header.held_architecture), else None; refused in one line where transformers
    cannot."""
    try:
        header = read_header(path, arrays=True) if held_architecture(arch) else None
        if header is not None:  # (config_dict, gguf_tokenizer: the same as transformers' GGUF readers)
            tokens = header.fields.get("tokenizer.ggml.tokens")
            config = AutoConfig.for_model(**config_dict(header, len(tokens) if isinstance(tokens, list) else None))
        else:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if header is not None and header.arch in GEMMA_TOKENIZERS:
            tok = gguf_tokenizer(header)
        else:
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"{path.name}: transformers cannot read it ({first})") from None
    return config, tok, header


def ensure_converted(path: Path, name: str, on_status: Callable[[str], None] | None = None) -> Path:
    dest = converted_dir(path, name)
    if not (dest / GGUF_POINTER).is_file():
        return convert(path, dest, on_status)
    repoint(dest / GGUF_POINTER, path)
    return dest


def repoint(pointer: Path, path: Path) -> None:
    """A converted folder is keyed by its GGUF's content (converted_dir), so the same file found at another
    path (the wheel reinstalled in another venv, the file moved) uses it: when the file it names is gone,
    name this one instead (written to a temp file, then renamed), so the folder given as --model still loads."""
    try:
        recorded = json.loads(pointer.read_text(encoding="utf-8"))
        if Path(recorded["source"]).is_file():
            return
        recorded["source"] = str(path.resolve())
        tmp = pointer.with_name(pointer.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(recorded, indent=1), encoding="utf-8")
        os.replace(tmp, pointer)
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable: loading from the folder says so (sources.gguf_of_converted); this path still loads
