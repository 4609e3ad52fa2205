"""The flags of `summarize`, `ask` and `plan`, grouped in a few dataclasses (model, cache, generation, output).

A command declares one parameter per group (`model: ModelOptions`); `@grouped` shows Typer the
groups' fields as ordinary options, in the order the command declares them, and hands the command the
filled dataclasses. A group is any dataclass with a PANEL (the benches' is specache_cli/bench_common.py's)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, ClassVar, Optional, get_args, get_type_hints

import typer

from engine.config import DECODING_DEFAULTS, CacheConfig, GenerationConfig, settings
from engine.kvcache.registry import describe

D = DECODING_DEFAULTS
# what --model takes (engine.model.sources.resolve_source), for summarize, ask and the benches
MODEL_HELP = ("The model: a local Hugging Face folder, a GGUF file, a Hugging Face id in the local cache, or "
              "ollama:NAME[:TAG] (`specache models` lists them here; default: the embedded SmolLM2-135M-Instruct).")


@dataclass
class ModelOptions:
    PANEL: ClassVar[str] = "Model"  # the heading of these options in --help

    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help=MODEL_HELP)] = None
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto"
    dtype: Annotated[str, typer.Option(
        help="auto (GPU: fp16; CPU: fp32, with prefill computed in bf16 where the CPU has native bf16), "
        "float32 (exact everywhere), float16 or bfloat16.")] = "auto"
    threads: Annotated[Optional[int], typer.Option(
        help="CPU threads (default: $OMP_NUM_THREADS, else the cores free when the run starts: on a busy "
        "machine fewer threads are much faster).", min=1)] = None


def setting_options(cls_name: str, panel: str, keep, before: list, after: list, aliases: bool = False) -> type:
    """An option group holding one flag per declared cache setting that `keep(setting)` accepts
    (engine.config.Setting: flag, aliases, help, default rule), between the fields `before` and `after`
    ((name, annotation, default) as dataclasses.make_dataclass takes them); aliases: the settings'
    other flag names too (`specache plan`'s). Every setting's option is
    unset (None) by default, so the run, the planner and the benches apply one default rule."""
    hints = get_type_hints(CacheConfig)
    made = []
    for name, declared in settings().items():
        if not keep(declared):
            continue
        kind = next(t for t in get_args(hints[name]) or (hints[name],) if t is not type(None))
        names = (declared.flag, *(declared.aliases if aliases else ()))
        if kind is bool and declared.switch:
            made.append((name, Annotated[bool, typer.Option(*names, help=declared.full_help)], False))
            continue
        if kind is bool:
            names = (f"{declared.flag}/--no-{declared.flag[2:]}",)
        made.append((name, Annotated[Optional[kind], typer.Option(*names, help=declared.full_help)], None))
    made = [(n, a, dataclasses.field(default=d)) for n, a, d in before + made + after]
    cls = dataclasses.make_dataclass(cls_name, made, namespace={"PANEL": panel, "overrides": _overrides})
    cls.__annotations__["PANEL"] = ClassVar[str]
    return cls


def _overrides(self) -> dict:
    """The settings given on the command line, for CacheConfig.with_overrides (unset: None; a switch
    not given is unset too)."""
    given = {name: getattr(self, name) for name in settings() if hasattr(self, name)}
    return {name: None if settings()[name].switch and not value else value for name, value in given.items()}


# summarize / ask: --cache, every setting with a flag, and the document store's two
CacheOptions = setting_options("CacheOptions", "KV cache", lambda s: s.cli, before=[
    ("cache", Annotated[str, typer.Option("--cache", help=f"KV cache mode: {describe()}.")], "specache"),
], after=[
    ("no_store", Annotated[bool, typer.Option(
        "--no-store", help="Neither load nor save the document's KV in the persistent store.")], False),
    ("cache_max_gb", Annotated[Optional[float], typer.Option(
        "--cache-max-gb", help="Size cap of the document store in GB; least recently used entries are evicted "
        "(default: $SPECACHE_CACHE_MAX_GB, else 20).")], None),
])
# plan: the settings the planner reads
PlanCacheOptions = setting_options("PlanCacheOptions", "KV cache", lambda s: s.plan is not None, [], [], aliases=True)


@dataclass
class GenerationOptions:
    PANEL: ClassVar[str] = "Generation"  # the heading of these options in --help

    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Most tokens to generate per answer (an answer cut by it ends at its last complete "
        "sentence; --json says finish_reason \"length\").")] = 256
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = D["temperature"]
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1 is off; with --temperature > 0).")
                     ] = D["top_p"]
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k likeliest tokens only (0 is off; with "
                                       "--temperature > 0).")] = D["top_k"]
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens less likely than this share of the likeliest "
                                         "(0 is off; with --temperature > 0).")] = D["min_p"]
    repeat_penalty: Annotated[float, typer.Option(
        "--repeat-penalty", help="Divide the scores of tokens already in the answer by this (1 is off).")
                              ] = D["repeat_penalty"]
    no_repeat_ngram: Annotated[int, typer.Option(
        "--no-repeat-ngram", help="Never repeat an n-gram of this many tokens within the answer (0 is off).")
                               ] = D["no_repeat_ngram"]
    seed: Annotated[int, typer.Option(help="Sampling seed: the same seed gives the same output.")] = 0
    strategy: Annotated[str, typer.Option(
        help="auto, single or map-reduce (for documents longer than the window).")] = "auto"
    batch: Annotated[str, typer.Option(
        "--batch", help="Sequences decoded together: auto (memory planner) or a number.")] = "auto"

    def config(self) -> GenerationConfig:
        """The engine's decoding settings (validated: a bad value raises BadArgument)."""
        return GenerationConfig(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                seed=self.seed, top_k=self.top_k, min_p=self.min_p,
                                repeat_penalty=self.repeat_penalty, no_repeat_ngram=self.no_repeat_ngram)


@dataclass
class OutputOptions:
    PANEL: ClassVar[str] = "Output"  # the heading of these options in --help

    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per result on stdout.")] = False
    jsonl: Annotated[bool, typer.Option("--jsonl", help="Print one JSON object per line (for batch jobs).")] = False
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress or timings on stderr.")] = False
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Say on stderr how the run was prepared: the model's source, format and window "
        "(and where it came from), the threads, the fit check, the cache defaults chosen and the decoder.")] = False
    password: Annotated[Optional[str], typer.Option(help="Password of encrypted PDFs.")] = None

    @property
    def structured(self) -> bool:
        return self.json_out or self.jsonl


@dataclass
class WorkerOptions:
    PANEL: ClassVar[str] = "Workers (Ray)"  # the heading of these options in --help

    workers: Annotated[Optional[int], typer.Option(
        "--workers", help="Run the job on N Ray actors, each holding the model (needs the extra: "
        "pip install 'specache\\[ray]'). Longest documents first; results as they complete.")] = None
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray-address", help="Join a Ray cluster: auto or HOST:PORT (default: a local runtime for the job).")] = None
    threads_per_worker: Annotated[Optional[int], typer.Option(
        "--threads-per-worker", help="Torch threads (and Ray CPUs) per worker (default: the cores divided "
        "among the workers).")] = None


def is_group(cls) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls) and hasattr(cls, "PANEL")


def grouped(fn):
    """Flatten the command's option-group parameters into Typer options; rebuild the groups on call."""
    hints = get_type_hints(fn, include_extras=True)
    params, groups, annotations = [], {}, {}
    for name, param in inspect.signature(fn).parameters.items():
        cls = hints.get(name)
        if is_group(cls):
            groups[name] = cls
            field_hints = get_type_hints(cls, include_extras=True)
            for f in dataclasses.fields(cls):
                for info in getattr(field_hints[f.name], "__metadata__", ()):
                    info.rich_help_panel = cls.PANEL  # None: among the command's own options
                params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                                annotation=field_hints[f.name]))
                annotations[f.name] = field_hints[f.name]
        else:
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY,
                                        annotation=hints.get(name, param.annotation)))
            annotations[name] = hints.get(name, param.annotation)
    names = [p.name for p in params]
    if len(names) != len(set(names)):
        raise TypeError(f"{fn.__name__}: an option name is used twice")

    @functools.wraps(fn)
    def wrapper(**kwargs):
        for name, cls in groups.items():
            kwargs[name] = cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls)})
        return fn(**kwargs)

    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = annotations
    return wrapper
