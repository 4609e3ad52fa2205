"""`specache models`: every model --model can name on this machine, with its size on disk and the
memory its weights take once loaded (held in their blocks for a GGUF)."""
from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.table import Table

from engine.errors import SpecacheError
from engine.model.gguf_header import file_type, read_header
from engine.model.loading import estimate_weight_bytes
from engine.model.sources import ModelSource, hf_hub_cache, list_models, ollama_models_dir
from specache_cli.cache_cmd import human
from specache_cli.console import err_console, guarded
from specache_cli.render import emit_json

KINDS = {"embedded": "embedded", "gguf": "GGUF file", "ollama": "ollama", "hf-cache": "HF cache", "folder": "folder"}


def describe(source: ModelSource) -> dict:
    """One row of the listing (name to pass to --model, kind, format, sizes, file)."""
    row = {"model": source.name, "kind": source.kind, "path": str(source.gguf or source.folder),
           "size_bytes": source.size_bytes, "format": "safetensors", "held_bytes": None}
    try:
        if source.gguf is not None:
            row["format"] = "GGUF " + file_type(read_header(source.gguf))
        row["held_bytes"] = estimate_weight_bytes(source)
    except (SpecacheError, OSError, ValueError, KeyError):
        row["format"] += " (unreadable)"
    return row


def models(json_out: bool = typer.Option(False, "--json", help="One JSON object per model, one a line.")) -> None:
    """List the models --model can name here: the embedded one, the local Hugging Face cache and ollama's."""
    rows = [describe(s) for s in list_models()]
    if json_out:
        for row in rows:
            emit_json(row, lines=True)
        return
    table = Table(box=None, pad_edge=False)
    for col in ("--model", "kind", "format", "on disk", "in memory", "path"):
        table.add_column(col, no_wrap=col != "path", overflow="fold")
    for r in rows:
        table.add_row(r["model"], KINDS.get(r["kind"], r["kind"]), r["format"], human(r["size_bytes"]),
                      human(r["held_bytes"]), r["path"])
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 1000).print(table)
    err_console.print(f"searched: the embedded model, {hf_hub_cache()} (Hugging Face), {ollama_models_dir()} "
                      f"(ollama); a .gguf file or a model folder can be given by its path", highlight=False,
                      markup=False)


def register(app: typer.Typer) -> None:
    app.command("models")(guarded(models))
