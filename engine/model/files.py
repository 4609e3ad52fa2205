"""A model named by --model, resolved once for a whole command: where its files are (engine.model.sources),
its GGUF header (read once), the folder of its config.json and tokenizer (a GGUF's converted once, when
first needed) and its config.json (read once). Everything that reads the model before or while loading
it (the window check, the fit check, the load, the planner) takes this one object.

The model's context window has one rule (window_rule): the config's own length key, else FALLBACK_WINDOW; a
GGUF's is its header's `<arch>.context_length` (what its converted config holds), read without converting the
file. The run's checks (engine.jobs.prepare), the loader (LoadedModel.max_context) and the planner's profiles
(engine.plan.profiles.model_profile_from_config) all take it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.errors import ModelLoadError
from engine.model.gguf_config import header_config
from engine.model.gguf_convert import ensure_converted
from engine.model.gguf_header import Header, read_header
from engine.model.sources import ModelSource, resolve_source

# the config keys that give a model's window, in the order transformers' config classes use them
WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
FALLBACK_WINDOW = 4096  # a config that names no window: what most of today's small models were trained with


def window_rule(config: dict) -> tuple[int, str]:
    """(the model's context window in tokens, where it comes from): the first positive integer of WINDOW_KEYS
    in its config (or its text_config, for a multimodal wrapper), else FALLBACK_WINDOW."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for values, prefix in ((config, ""), (text, "text_config.")):
        for key in WINDOW_KEYS:
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"config.json's {prefix}{key}"
    return FALLBACK_WINDOW, f"config.json names none: the fallback {FALLBACK_WINDOW}"


def context_window(config: dict) -> int:
    """The model's context window in tokens (window_rule)."""
    return window_rule(config)[0]


@dataclass
class ModelFiles:
    """--model resolved once (see the module's docstring). on_status: where a first conversion says so."""

    source: ModelSource
    on_status: Callable[[str], None] | None = None
    _header: Header | None = field(default=None, repr=False)
    _folder: Path | None = field(default=None, repr=False)
    _config: dict | None = field(default=None, repr=False)
    _config_bytes: bytes | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def is_gguf(self) -> bool:
        return self.source.gguf is not None

    @property
    def header(self) -> Header:
        """The GGUF's header (a GGUF source only)."""
        if self._header is None:
            self._header = read_header(self.source.gguf)
        return self._header

    @property
    def folder(self) -> Path:
        """The folder with config.json and the tokenizer: the model's own, or its GGUF's converted once."""
        if self._folder is None:
            self._folder = self.source.folder if not self.is_gguf else \
                ensure_converted(self.source.gguf, self.source.name, self.on_status)
        return self._folder

    @property
    def config(self) -> dict:
        """config.json's values. Raises ModelLoadError when it cannot be read as a JSON object."""
        if self._config is None:
            path = self.folder / "config.json"
            try:
                raw = path.read_bytes()
                config = json.loads(raw.decode("utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                raise ModelLoadError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
            if not isinstance(config, dict):
                raise ModelLoadError(f"{path} is not a JSON object")
            self._config, self._config_bytes = config, raw
        return self._config

    @property
    def plan_config(self) -> dict:
        """The config the planner reads: config.json's (read once), or a held GGUF's made from its header
        (engine.model.gguf_config.header_config) where the file is not converted yet, so a plan converts nothing."""
        if self.is_gguf and self._config is None:
            made = header_config(self.header)
            if made is not None:
                return made
        return self.config

    @property
    def config_bytes(self) -> bytes:
        """config.json as read (once, with `config`): the model's fingerprint hashes it."""
        _ = self.config
        return self._config_bytes

    @property
    def window(self) -> int:
        """The context window (window_rule), a GGUF's from its header without converting it."""
        return self.window_and_origin[0]

    @property
    def window_origin(self) -> str:
        """Where the window comes from, in words (what -v says)."""
        return self.window_and_origin[1]

    @property
    def window_and_origin(self) -> tuple[int, str]:
        if self.is_gguf and self._config is None:
            key = f"{self.header.arch}.context_length"
            length = self.header.fields.get(key)
            if isinstance(length, int) and length > 0:
                return length, f"the GGUF header's {key}"
        return window_rule(self.config)


def model_files(spec: "str | None | ModelFiles", on_status: Callable[[str], None] | None = None) -> ModelFiles:
    """--model -> its ModelFiles (resolve_source, once); a ModelFiles is returned as it is."""
    if isinstance(spec, ModelFiles):
        return spec
    return ModelFiles(resolve_source(spec), on_status)
