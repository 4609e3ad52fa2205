"""A run of summarize or ask, prepared once below the CLI (the CLI turns its flags into a RunRequest, renders
what the Runner yields and maps errors to exit codes; it does no engine work):

- the model named by --model resolved once: engine.model.files.ModelFiles (its source, its GGUF header and its
  config.json each read once), which the window check, the fit check, the load and the planner all take;
- its window by the one rule (engine.model.files.window_rule): the config's own length key
  (max_position_embeddings, n_positions, max_sequence_length, seq_length; a multimodal wrapper's text_config's),
  else FALLBACK_WINDOW (4096); a GGUF's from its header's `<arch>.context_length` without converting it. The
  loader (LoadedModel.max_context) and the planner (engine.plan.profiles.model_profile_from_config) apply the
  same rule, so the CLI's checks, the plan and the job's sections agree;
- the flags that size buffers in tokens checked against that window, the fit check before loading (on a CPU),
  the model's cache defaults applied once after loading (engine.plan.profiles.profile_defaults: the model
  profile's bits, group, k and prefetch; engine.config declares the defaults of a model without a profile), the
  flags given over them, and the settings cut to the longest model call.

Callbacks (Notes): status (progress), warning (one line each) and detail (-v: each resolution step); a
None callback is silent."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from engine.backends import devices
from engine.config import CacheConfig, GenerationConfig, settings
from engine.docstore.store import DocStore, check_folder, max_bytes_from
from engine.errors import BadArgument, ProfileError
from engine.jobs.pipeline import STRATEGIES, Runner, count_tokens
from engine.kvcache import policy
from engine.model.files import ModelFiles, model_files
from engine.model.loading import DTYPES, LoadedModel, estimate_weight_bytes, holds_blocks, load_model
from engine.paths import cache_root
from engine.plan.planner import check_fits_before_load
from engine.plan.profiles import loaded_model_profile, model_defaults
from engine.plan.threads import choose_threads

PROMPT_SLACK = 512  # tokens a prompt may add around the document and question (chat template, labels)
# the settings that size buffers in tokens (engine.config.Setting.tokens): bounded by the model's window
WINDOW_FLAGS = {name: declared for name, declared in settings().items() if declared.tokens}


@dataclass(frozen=True)
class RunRequest:
    """What a run asks for, as the flags give it. overrides: the cache settings given (None: unset, the
    default rule applies); cache_max_gb: the store's cap (None: $SPECACHE_CACHE_MAX_GB, else the default)."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    mode: str = "specache"
    overrides: dict = field(default_factory=dict)
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    strategy: str = "auto"
    batch: int | None = None  # rows decoded together; None: the planner decides
    store: bool = True  # the persistent document store (--no-store: False)
    cache_max_gb: float | None = None


@dataclass
class Notes:
    """Where a preparation reports: progress, warnings and (-v) its resolution steps; None is silent."""

    status: Callable[[str], None] | None = None
    warning: Callable[[str], None] | None = None
    detail: Callable[[str], None] | None = None

    def say(self, kind: str, message: str) -> None:
        tell = getattr(self, kind)
        if tell is not None:
            tell(message)


def check_device(device: str, dtype: str) -> None:
    """--device and --dtype, before anything is loaded: names only, and CUDA only where there is one
    (engine.backends.devices)."""
    devices.check_name(device)
    if dtype not in DTYPES:
        raise BadArgument(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    devices.check_present(device)


def check_window(overrides: dict, max_tokens: int, window: int) -> None:
    """Settings that size buffers in tokens, against the model's window: none may exceed it (a bigger
    value could only waste memory), and --max-tokens leaves at least half the window to the document."""
    for name, declared in WINDOW_FLAGS.items():
        value = overrides.get(name)
        if value is not None and value > window:
            raise BadArgument(f"{declared.flag} {value} is more than the model's window of {window} tokens "
                              f"(at most {window})")
    if max_tokens > window // 2:
        raise BadArgument(f"--max-tokens {max_tokens} leaves too little of the model's {window}-token window for "
                          f"the document (at most {window // 2})")


def clamp_to_prompt(config: CacheConfig, longest: int) -> tuple[CacheConfig, list[str]]:
    """The cache settings with k, sinks, residual and chunk_size cut to `longest` (tokens of the
    longest model call: prompt and answer); beyond it they change nothing but the size of buffers.
    -> (config, the flags cut, as "--k 5000")."""
    cut, notes = {}, []
    for name, declared in WINDOW_FLAGS.items():
        value = getattr(config, name)
        if value > longest:
            cut[name] = max(longest, declared.low or 1)
            if cut[name] < value:
                notes.append(f"{declared.flag} {value}")
    return (replace(config, **cut) if cut else config), notes


def store_cap(cache_max_gb: float | None) -> int | None:
    """The document store's cap in bytes (engine.docstore.store.max_bytes_from); a bad one is BadArgument."""
    try:
        return max_bytes_from(cache_max_gb)
    except ValueError as exc:
        raise BadArgument(f"--cache-max-gb: {exc}") from None


class PreparedRun:
    """A run's flags checked and its model resolved up front; the model loaded on first use of `runner` (so
    bad flags and unreadable documents are reported before any model load)."""

    def __init__(self, request: RunRequest, notes: Notes | None = None):
        if request.strategy not in STRATEGIES:
            raise BadArgument(f"--strategy must be one of {', '.join(STRATEGIES)}, not {request.strategy!r}")
        check_device(request.device, request.dtype)
        self.policy = policy(request.mode)  # the mode's class, resolved once: a registered mode (BadArgument)
        CacheConfig(mode=request.mode).with_overrides(**request.overrides)  # the settings, checked now
        self.request, self.notes = request, notes or Notes()
        self.store_max_bytes = store_cap(request.cache_max_gb)
        self.files: ModelFiles = model_files(request.model, self.notes.status)  # resolved once for the run
        self.window = self.files.window
        describe_model(self.files, self.notes)
        check_window(request.overrides, request.gen.max_tokens, self.window)
        if self.files.source.kind == "embedded" or request.store:  # the converted model and the store live there
            check_folder(cache_root())
        self.longest_text = ""  # the longest document (and question) read: bounds the cache settings
        self.pick_threads = True  # False in a worker's copy: its threads come from --threads-per-worker
        self._runner: Runner | None = None

    def saw(self, *texts: str) -> None:
        """Note the text of a document (or question) read, so the cache settings can be cut to its length."""
        self.longest_text = max((self.longest_text, *texts), key=len)

    @property
    def runner(self) -> Runner:
        """The job's Runner: threads chosen, the fit checked, the model loaded, its cache settings applied."""
        if self._runner is None:
            r = self.request
            if self.pick_threads:
                self.set_threads(r.threads)
            self.check_fits()
            lm = load_model(self.files, device=r.device, dtype=r.dtype, on_status=self.notes.status,
                            on_warning=self.notes.warning)
            self.notes.say("status", f"model {lm.name} on {lm.device} ({lm.dtype}) loaded in {lm.load_seconds:.1f} s")
            describe_decoder(lm, r.dtype, self.notes)
            self._runner = Runner(lm, self.cache_config(lm), r.gen, r.strategy, r.batch, store=self.store(),
                                  policy=self.policy)
        return self._runner

    def cache_config(self, lm: LoadedModel) -> CacheConfig:
        """The cache settings of the run: the model's defaults (its profile's, once), the flags given over them,
        then cut to the longest model call."""
        r = self.request
        profile = loaded_model_profile(lm)
        defaults = model_defaults(lm, r.overrides.get("prefetch"), profile)
        cache = CacheConfig(mode=r.mode, **defaults).with_overrides(**r.overrides)
        given = {name: value for name, value in r.overrides.items() if value is not None}
        self.notes.say("detail", f"defaults: {describe_defaults(defaults)} (model profile {profile.name}, "
                       f"{lm.device.type}); given: {', '.join(f'{k} {v}' for k, v in given.items()) or 'none'}")
        floor = min(lm.max_context, r.gen.max_tokens + PROMPT_SLACK)  # no call is shorter than this bound
        if any(getattr(cache, f) > floor for f in WINDOW_FLAGS):  # (counting tokens costs ~1 s per 100k)
            longest = min(lm.max_context, count_tokens(lm.tokenizer, self.longest_text) + floor)
            cache, notes = clamp_to_prompt(cache, longest)
            if notes:
                self.notes.say("status", f"{', '.join(notes)}: cut to {longest} tokens, the longest model call here")
        return cache

    def check_fits(self) -> None:
        """Before loading: the weights as they will be held and one sequence's cache of the longest
        call (its text counted at 4 characters a token, the least a tokenizer gives), with the settings
        given (--k, --residual, ...; the others by their default rule), must fit in memory."""
        r = self.request
        if devices.pick_device(r.device).type != "cpu":
            return  # the GPU's check runs after loading (plan_for_run), with the device's own free memory
        files = self.files
        context = min(self.window, r.gen.max_tokens + PROMPT_SLACK + len(self.longest_text) // 4)
        try:
            held = estimate_weight_bytes(files, r.dtype)
            check_fits_before_load(files.config, held, context, self.policy, r.overrides, name=files.name)
        except ProfileError:
            return  # a config without the model's shapes: the load itself reports what is wrong
        self.notes.say("detail", f"fit: weights {held / 2**30:.2f} GiB as held and one sequence of {context} "
                       f"tokens fit in this machine's memory")

    def set_threads(self, requested: int | None) -> None:
        """torch's CPU threads for this run (engine.plan.threads: --threads, $OMP_NUM_THREADS or the
        free cores); a note when the machine is busy and fewer than its cores are used."""
        choice = choose_threads(requested)
        torch.set_num_threads(choice.threads)
        self.notes.say("detail", f"threads: {choice.threads} of {choice.cores} cores ({choice.reason})")
        if choice.reason == "free cores" and choice.threads < choice.cores:
            self.notes.say("status", f"the machine is busy ({choice.busy:.1f} of {choice.cores} cores in use by "
                           f"other work): {choice.threads} thread{'s' if choice.threads > 1 else ''} "
                           f"(--threads to choose)")

    def store(self) -> DocStore | None:
        """The persistent document store, unless the request has none; opening it applies its cap."""
        if not self.request.store:
            return None
        store = DocStore(max_bytes=self.store_max_bytes, warn=self.notes.warning, note=self.notes.status)
        store.tidy()
        return store

    def for_worker(self) -> "PreparedRun":
        """The copy a Ray actor builds its Runner from: silent (the driver shows progress), its threads
        the actor's own (--threads-per-worker), the model as this run resolved it."""
        own = copy.copy(self)
        own.notes = Notes()
        own.files = dataclasses.replace(self.files, on_status=None)
        own.pick_threads = False
        return own


def describe_model(files: ModelFiles, notes: Notes) -> None:
    """-v: what --model resolved to, its format and its window (and where the window came from)."""
    if notes.detail is None:
        return
    source = files.source
    where = source.gguf if source.gguf is not None else source.folder
    notes.detail(f"model: {files.name} ({source.kind}: {where})")
    if files.is_gguf:
        notes.detail(f"format: GGUF, architecture {files.header.arch}")
    else:
        notes.detail(f"format: Hugging Face folder, model type {files.config.get('model_type')!r}")
    notes.detail(f"window: {files.window} tokens ({files.window_origin})")


def describe_decoder(lm: LoadedModel, dtype: str, notes: Notes) -> None:
    """-v: which classes run the model and how its weights are held, and why not as stored when they are not
    (the reason for transformers' classes is load_model's warning)."""
    if notes.detail is None:
        return
    cls = type(lm.model)
    own = cls.__module__.startswith("engine.")
    held = f"in {str(lm.dtype).removeprefix('torch.')}"
    if getattr(lm.model, "specache_held", False):
        held = "held as stored (quantized blocks or 16-bit)"
    elif not own:
        held += ", not held as stored: transformers' classes (the warning says why)"
    elif not holds_blocks(lm.device, dtype):
        held += f", not held as stored: --dtype {dtype} on {lm.device.type} (held only on a CPU with --dtype auto)"
    else:
        held += ", not held as stored: its files hold no 16-bit or quantized weights"
    owner = "the engine's" if own else "transformers'"
    notes.detail(f"decoder: {owner} {cls.__name__}, weights {held}")


def describe_defaults(defaults: dict) -> str:
    """The default cache settings of a model, as -v shows them."""
    grows = " (grows with the context)" if defaults.get("k_grows") else ""
    return (f"bits {defaults['bits']}, group {defaults['group']}, k {defaults['k']}{grows}, "
            f"prefetch {defaults['prefetch']}")
