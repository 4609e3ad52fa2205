"""What `--model` names, resolved to files on this machine without reaching a hub.

Four ways to name a model (and the embedded default):
  - a `.gguf` file (llama.cpp, LM Studio, an ollama blob): its config, tokenizer and chat template are
    converted once into a cached folder keyed by the file's identity (engine.model.gguf_convert); the
    weights stay in the file and are read from it at load time;
  - a Hugging Face id (`Qwen/Qwen2.5-0.5B-Instruct`), looked up in the local Hugging Face cache
    ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub); nothing is downloaded;
  - `ollama:NAME[:TAG]`: the model's GGUF blob, found through ollama's manifests ($OLLAMA_MODELS,
    default ~/.ollama/models);
  - a local Hugging Face model folder, as before.
`list_models()` is what `specache models` shows.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InputNotFound, ModelLoadError
from engine.model.embedded import EMBEDDED_NAME, EMBEDDED_PROFILE, find_embedded_gguf

EMBEDDED_SPECS = (None, "", "default", EMBEDDED_NAME, EMBEDDED_PROFILE)  # --model values naming the embedded model
OLLAMA_PREFIX = "ollama:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as transformers users write it
GGUF_POINTER = "specache-gguf.json"  # in a converted folder: the GGUF file its weights are read from


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a Hugging Face folder, or a GGUF file (weights read from it)."""

    kind: str  # "embedded", "gguf", "ollama", "hf-cache" or "folder"
    name: str  # shown to the user, in --json "model"
    folder: Path | None = None  # a Hugging Face folder (config.json, weights)
    gguf: Path | None = None  # a GGUF file (config and tokenizer converted once; weights read from it)

    @property
    def size_bytes(self) -> int:
        """Bytes of the model's files (the GGUF, or the folder's weight files)."""
        if self.gguf is not None:
            return self.gguf.stat().st_size
        return folder_weight_bytes(self.folder) if self.folder is not None else 0

    def as_json(self) -> dict:
        """The source as a child process takes it (source_from_json): resolved once, by the parent."""
        return {"kind": self.kind, "name": self.name, "folder": None if self.folder is None else str(self.folder),
                "gguf": None if self.gguf is None else str(self.gguf)}


def source_from_json(given: dict) -> ModelSource:
    """ModelSource.as_json's dict back (in a bench's child process: the model as its parent resolved it)."""
    return ModelSource(given["kind"], given["name"], folder=None if given["folder"] is None else Path(given["folder"]),
                       gguf=None if given["gguf"] is None else Path(given["gguf"]))


def folder_weight_bytes(folder: Path) -> int:
    files = [*folder.glob("*.safetensors"), *folder.glob("*.bin"), *folder.glob("*.gguf")]
    return sum(f.stat().st_size for f in files if f.is_file())


def is_embedded(spec: str | None) -> bool:
    return spec in EMBEDDED_SPECS


def resolve_source(spec: str | None) -> ModelSource:
    """--model -> where its files are. Raises InputNotFound for a path that does not exist and
    ModelLoadError for a name that does not resolve (each with a one-line message)."""
    if is_embedded(spec):
        return ModelSource("embedded", EMBEDDED_NAME, gguf=find_embedded_gguf())
    assert spec is not None
    if spec.startswith(OLLAMA_PREFIX):
        return resolve_ollama(spec[len(OLLAMA_PREFIX):])
    path = Path(spec).expanduser()
    if path.exists():
        return resolve_path(path, spec)
    if looks_like_hf_id(spec):
        return resolve_hf_id(spec)
    if path.suffix.lower() == ".gguf":
        raise InputNotFound(f"GGUF file not found: {spec}")
    raise InputNotFound(f"model not found: {spec} (give a .gguf file, a Hugging Face model folder, "
                        f"a Hugging Face id from the local cache, or ollama:NAME[:TAG])")


def looks_like_hf_id(spec: str) -> bool:
    return bool(HF_ID.fullmatch(spec)) and not spec.startswith((".", "~")) and not spec.endswith(".gguf")


def resolve_path(path: Path, spec: str) -> ModelSource:
    """A file (GGUF) or a folder (Hugging Face, or one converted from a GGUF)."""
    if path.is_file():
        if not is_gguf_file(path):
            raise ModelLoadError(f"{spec} is neither a GGUF file nor a Hugging Face model folder (no config.json)")
        return ModelSource("gguf", path.stem, gguf=path)
    pointer = path / GGUF_POINTER
    if pointer.is_file():  # a folder converted from a GGUF: load from that GGUF
        return ModelSource("gguf", path.name, gguf=gguf_of_converted(pointer))
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].stem, gguf=ggufs[0])
        raise ModelLoadError(f"{spec} is not a Hugging Face model folder (no config.json)"
                             + (f" and holds {len(ggufs)} .gguf files: name one" if ggufs else ""))
    return ModelSource("folder", path.name, folder=path)


def gguf_of_converted(pointer: Path) -> Path:
    try:
        source = Path(json.loads(pointer.read_text(encoding="utf-8"))["source"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{pointer} cannot be read ({type(exc).__name__})") from None
    if not source.is_file():
        raise ModelLoadError(f"{pointer.parent} was converted from {source}, which is gone")
    return source


def is_gguf_file(path: Path) -> bool:
    """Whether the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# --- the Hugging Face cache ----------------------------------------------------------------------

def hf_hub_cache() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (huggingface_hub's own rule)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                            / "huggingface")
    return Path(home).expanduser() / "hub"


def hf_snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main points at, else the newest snapshot folder; None if there is none."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if snap.is_dir():
            return snap
    snaps = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
    return max(snaps, key=lambda s: s.stat().st_mtime) if snaps else None


def resolve_hf_id(model_id: str) -> ModelSource:
    cache = hf_hub_cache()
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snap = hf_snapshot(repo) if repo.is_dir() else None
    if snap is None:
        raise ModelLoadError(f"{model_id} is not in the local Hugging Face cache ({cache}); get it with "
                             f"`huggingface-cli download {model_id}` (specache downloads nothing)")
    if (snap / "config.json").is_file():
        return ModelSource("hf-cache", model_id, folder=snap)
    ggufs = sorted(snap.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", f"{model_id}/{ggufs[0].name}", gguf=ggufs[0].resolve())
    raise ModelLoadError(f"{model_id} in the Hugging Face cache has no config.json"
                         + (f" and {len(ggufs)} .gguf files: give one of them as a path" if ggufs else
                            " (an incomplete download?)"))


# --- ollama --------------------------------------------------------------------------------------

def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_manifest(name: str) -> Path:
    """NAME[:TAG] -> its manifest file: library models (`llama3.2`), a user's (`user/model`), or a
    full host/namespace/model name."""
    model, _, tag = name.partition(":")
    parts = [p for p in model.split("/") if p]
    if not parts:
        raise ModelLoadError("ollama: needs a model name, as in ollama:llama3.2 or ollama:qwen2.5:0.5b")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    return ollama_models_dir() / "manifests" / Path(*parts) / (tag or "latest")


def resolve_ollama(name: str) -> ModelSource:
    manifest = ollama_manifest(name)
    if not manifest.is_file():
        raise ModelLoadError(f"ollama model {name} not found (no {manifest}); get it with `ollama pull {name}` "
                             f"or set OLLAMA_MODELS")
    blob = ollama_blob(manifest)
    return ModelSource("ollama", OLLAMA_PREFIX + name, gguf=blob)


def ollama_blob(manifest: Path) -> Path:
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration, AttributeError):
        raise ModelLoadError(f"{manifest} is not an ollama manifest with a model layer") from None
    blob = ollama_models_dir() / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise ModelLoadError(f"the blob of {manifest} is missing: {blob}")
    if not is_gguf_file(blob):
        raise ModelLoadError(f"the model blob of {manifest} is not a GGUF file: {blob}")
    return blob


# --- specache models -----------------------------------------------------------------------------

def list_models() -> list[ModelSource]:
    """Every model --model can name here: the embedded one, the Hugging Face cache's causal LMs
    (and GGUF-only repos with one file), and ollama's models."""
    found: list[ModelSource] = []
    try:
        found.append(resolve_source(None))
    except ModelLoadError:
        pass
    found += hf_cache_models()
    found += ollama_models()
    return found


def hf_cache_models() -> list[ModelSource]:
    out = []
    cache = hf_hub_cache()
    for repo in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        model_id = repo.name[len("models--"):].replace("--", "/", 1)
        try:
            out.append(resolve_hf_id(model_id))
        except ModelLoadError:
            continue
    return out


def ollama_models() -> list[ModelSource]:
    root = ollama_models_dir() / "manifests"
    out = []
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []:
        rel = manifest.relative_to(root).parts  # host, namespace, model, tag
        if len(rel) != 4:
            continue
        host, namespace, model, tag = rel
        name = model if (host, namespace) == (OLLAMA_REGISTRY, "library") else \
            (f"{namespace}/{model}" if host == OLLAMA_REGISTRY else f"{host}/{namespace}/{model}")
        try:
            out.append(ModelSource("ollama", f"{OLLAMA_PREFIX}{name}:{tag}", gguf=ollama_blob(manifest)))
        except ModelLoadError:
            continue
    return out
