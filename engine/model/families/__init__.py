"""Model families by config.json's model_type: the one list that the loader (which decoder builds a
model), the support check (which model types are run), the GGUF reader (which architectures stay in
their blocks), the planner and the docs read. Each module of this package registers its families
(`register(ModelFamily(...))`); `discover` imports every such module on the first look-up, so a new
family is a new file here, with no list to edit."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

PACKAGE = "engine.model.families"
DECODERS = ("llama", "gemma")  # engine.model.llama.CausalLM, engine.model.gemma.GemmaCausalLM


@dataclass(frozen=True)
class ModelFamily:
    """One model type the engine runs.

    model_type: config.json's. checked: what the conformance test checks on it (tests/test_conformance.py;
    the docs' model list). decoder: which of the engine's decoders builds it ("llama", "gemma"), None
    when transformers' classes run it with the engine's attention. spec: that decoder's per-family record
    (engine.model.llama.Family, engine.model.gemma.GemmaFamily). gguf_architectures: the GGUF
    general.architecture values whose tensors the engine holds in their blocks for it. qkv_bias: the
    planner's parameter count assumes q/k/v biases where a config does not say (attention_bias)."""

    model_type: str
    checked: str
    decoder: str | None = None
    spec: object = None
    gguf_architectures: tuple[str, ...] = ()
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.decoder not in (None, *DECODERS):
            raise ValueError(f"family {self.model_type!r}: decoder {self.decoder!r} is not one of {DECODERS}")
        if (self.decoder is None) != (self.spec is None):
            raise ValueError(f"family {self.model_type!r}: a decoder and its spec go together")


FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is registered twice")
    FAMILIES[family.model_type] = family
    return family


def discover() -> dict[str, ModelFamily]:
    """Every family, its package's modules imported on the first call."""
    if not FAMILIES:
        package = importlib.import_module(PACKAGE)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{PACKAGE}.{module.name}")
    return FAMILIES


def family(model_type: str | None) -> ModelFamily | None:
    return discover().get(model_type)


def spec(model_type: str | None, decoder: str):
    """The decoder's record for a model type it builds, else None."""
    found = family(model_type)
    return found.spec if found is not None and found.decoder == decoder else None


def checked() -> dict[str, str]:
    """model_type -> what the conformance test checks on it, for every family (by model type)."""
    return {name: f.checked for name, f in sorted(discover().items())}


def held_architectures() -> tuple[str, ...]:
    """The GGUF architectures held in their blocks."""
    return tuple(arch for f in discover().values() for arch in f.gguf_architectures)


DECODER_NAMES = {"llama": "the engine's Llama decoder", "gemma": "the engine's Gemma decoder",
                 None: "transformers' classes, the engine's attention"}
TABLE_HEADER = ("| model type | checked (tests/test_conformance.py) | runs in | GGUF architectures held |\n"
                "|---|---|---|---|")


def docs_table() -> str:
    """The README's table of the model families (tests/test_families.py checks the README holds it)."""
    rows = [f"| `{name}` | {f.checked} | {DECODER_NAMES[f.decoder]} | "
            f"{', '.join(f'`{a}`' for a in f.gguf_architectures) or '-'} |" for name, f in sorted(discover().items())]
    return "\n".join([TABLE_HEADER, *rows])
