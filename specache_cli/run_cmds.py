"""`specache summarize` and `specache ask`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from engine.config import CacheConfig, GenerationConfig
from engine.errors import BadArgument, BatchFailures, SpecacheError
from engine.pipeline import STRATEGIES, Runner, ask, summarize
from specache_cli.console import err_console, guarded
from specache_cli.render import emit_json, print_timings, progress_bar, render_job

DEFAULT_CACHE = "full"


def _runner(model, device, dtype, cache, bits, group, k, residual, sinks, chunk_size, max_tokens, temperature,
            top_p, seed, strategy, quiet, hit_rate=False):
    """Validate the flags now; return a function that loads the model on first call (so bad flags and
    unreadable documents are reported before any model load)."""
    if strategy not in STRATEGIES:
        raise BadArgument(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    cache_cfg = CacheConfig(mode=cache).with_overrides(bits=bits, group=group, k=k, residual=residual,
                                                       sinks=sinks, chunk_size=chunk_size,
                                                       measure_hits=hit_rate or None)
    gen = GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    loaded: list[Runner] = []

    def get() -> Runner:
        if not loaded:
            from engine.model import load_model

            status = None if quiet else (lambda m: err_console.print(f"[dim]{m}[/]", highlight=False))
            lm = load_model(model, device=device, dtype=dtype, on_status=status)
            if not quiet:
                err_console.print(f"[dim]model {lm.name} on {lm.device} ({lm.dtype}) loaded in "
                                  f"{lm.load_seconds:.1f} s[/]", highlight=False)
            loaded.append(Runner(lm, cache_cfg, gen, strategy))
        return loaded[0]

    return get


def _load(source: str, password: Optional[str], quiet: bool):
    """Read one document, with a page progress bar for PDFs."""
    from engine.documents import load_document

    with progress_bar(quiet) as bar:
        task = bar.add_task(f"reading {Path(source).name}", total=None)
        doc = load_document(source, password=password, on_page=lambda i, n: bar.update(task, completed=i + 1, total=n),
                            stdin=sys.stdin)
    return doc


MODEL = typer.Option(None, "--model", "-m", help="Local Hugging Face model folder (default: embedded SmolLM2-135M-Instruct).")
DEVICE = typer.Option("auto", help="auto, cpu or cuda.")
DTYPE = typer.Option("auto", help="auto (fp32 on CPU, fp16 on GPU), float32, float16 or bfloat16.")
CACHE = typer.Option(DEFAULT_CACHE, "--cache", help="KV cache mode: full, specache, kivi or window.")
BITS = typer.Option(None, help="Guide code width, 1 or 2.")
GROUP = typer.Option(None, help="Quantization group size, 32 or 64.")
K = typer.Option(None, "--k", help="Exact positions fetched per layer and KV head each step.")
RESIDUAL = typer.Option(None, help="Newest tokens kept exact on the device.")
SINKS = typer.Option(None, help="First tokens kept exact on the device.")
CHUNK = typer.Option(None, "--chunk-size", help="Prefill chunk size in tokens.")
MAX_TOKENS = typer.Option(256, "--max-tokens", help="Most tokens to generate per answer.")
TEMPERATURE = typer.Option(0.0, help="0 is greedy.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling mass.")
SEED = typer.Option(0, help="Sampling seed: the same seed gives the same output.")
STRATEGY = typer.Option("auto", help="auto, single or map-reduce (for documents longer than the window).")
JSON = typer.Option(False, "--json", help="Print one JSON object per result on stdout.")
JSONL = typer.Option(False, "--jsonl", help="Print one JSON object per line (for batch jobs).")
PASSWORD = typer.Option(None, help="Password of encrypted PDFs.")
HIT_RATE = typer.Option(False, "--hit-rate", help="specache: measure the prefetch hit rate (costs a full attention per step).")
QUIET = typer.Option(False, "--quiet", help="No progress or timings on stderr.")


def summarize_cmd(
    files: list[str] = typer.Argument(..., help="PDF, .txt or .md files; - reads stdin."),
    model: Optional[str] = MODEL, device: str = DEVICE, dtype: str = DTYPE, cache: str = CACHE,
    bits: Optional[int] = BITS, group: Optional[int] = GROUP, k: Optional[int] = K,
    residual: Optional[int] = RESIDUAL, sinks: Optional[int] = SINKS, chunk_size: Optional[int] = CHUNK,
    max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, top_p: float = TOP_P, seed: int = SEED,
    strategy: str = STRATEGY, json_out: bool = JSON, jsonl: bool = JSONL, password: Optional[str] = PASSWORD,
    quiet: bool = QUIET, hit_rate: bool = HIT_RATE,
) -> None:
    """Summarize each document."""
    get_runner = _runner(model, device, dtype, cache, bits, group, k, residual, sinks, chunk_size, max_tokens,
                         temperature, top_p, seed, strategy, quiet, hit_rate)
    structured = json_out or jsonl
    failures = 0
    for source in files:
        try:
            doc = _load(source, password, quiet)
            if len(files) > 1 and not structured:
                sys.stdout.write(f"# {source}\n")
            result = render_job(summarize(get_runner(), doc.text, source), quiet, stream_text=not structured)
        except SpecacheError as exc:
            if len(files) == 1:
                raise
            failures += 1
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
            if structured:
                emit_json({"source": source, "error": {"code": exc.code, "exit_code": exc.exit_code,
                                                       "message": str(exc)}}, jsonl)
            continue
        if structured:
            emit_json(result.to_json(), jsonl)
        if not quiet:
            print_timings(result)
    if failures:
        raise BatchFailures(f"{failures} of {len(files)} documents failed")


def ask_cmd(
    question: Optional[str] = typer.Argument(None, help="The question."),
    doc: list[str] = typer.Option(..., "--doc", "-d", help="Document(s) forming the corpus; repeat for several."),
    questions: list[str] = typer.Option([], "--question", "-q", help="More questions; repeat for several."),
    model: Optional[str] = MODEL, device: str = DEVICE, dtype: str = DTYPE, cache: str = CACHE,
    bits: Optional[int] = BITS, group: Optional[int] = GROUP, k: Optional[int] = K,
    residual: Optional[int] = RESIDUAL, sinks: Optional[int] = SINKS, chunk_size: Optional[int] = CHUNK,
    max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, top_p: float = TOP_P, seed: int = SEED,
    strategy: str = STRATEGY, json_out: bool = JSON, jsonl: bool = JSONL, password: Optional[str] = PASSWORD,
    quiet: bool = QUIET, hit_rate: bool = HIT_RATE,
) -> None:
    """Answer questions about a document or a corpus of documents."""
    asked = ([question] if question else []) + list(questions)
    if not asked:
        raise BadArgument("ask needs a question: specache ask --doc FILE \"question\"")
    if any(not q.strip() for q in asked):
        raise BadArgument("a question is empty")
    get_runner = _runner(model, device, dtype, cache, bits, group, k, residual, sinks, chunk_size, max_tokens,
                         temperature, top_p, seed, strategy, quiet, hit_rate)
    docs = [_load(source, password, quiet) for source in doc]
    runner = get_runner()
    text = docs[0].text if len(docs) == 1 else "\n\n".join(f"=== {d.source} ===\n{d.text}" for d in docs)
    source = ", ".join(d.source for d in docs)
    structured = json_out or jsonl
    for q in asked:
        if len(asked) > 1 and not structured:
            sys.stdout.write(f"Q: {q}\n")
        result = render_job(ask(runner, text, source, q), quiet, stream_text=not structured)
        if structured:
            emit_json(result.to_json(), jsonl)
        if not quiet:
            print_timings(result)


def register(app: typer.Typer) -> None:
    app.command("summarize")(guarded(summarize_cmd))
    app.command("ask")(guarded(ask_cmd))
