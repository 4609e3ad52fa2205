"""The config and tokenizer of a held architecture's GGUF, made from its header.

transformers reads a GGUF's config through the gguf package's reader, which builds numpy views of every
metadata value (Gemma 3's 262k-token vocabulary: ~15 s), and derives a Gemma tokenizer's ~515k merges in a
Python loop over the vocabulary (~8 s). For the held architectures the same config and tokenizer are made
here from read_header(arrays=True) (0.2 s) with transformers' own key tables and tokenizer builders, and the
merges by the same rule, vectorised (gemma_merges); tests/test_gemma_gguf.py checks they are transformers'.
engine.model.gguf_convert writes them into the converted folder.
"""
from __future__ import annotations

import numpy as np

from engine.model.gguf_header import Header, held_architecture

GEMMA_TOKENIZERS = ("gemma2", "gemma3")  # the builds whose merges gemma_merges derives (transformers' gemma_tokenizer)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


def config_dict(header: Header, vocab_size: int | None) -> dict:
    """The transformers config dict of a held architecture's GGUF, as transformers' legacy GGUF reader makes it
    (its key tables GGUF_CONFIG_MAPPING and GGUF_CONFIG_DEFAULTS_MAPPING; a tied output when the file has no
    output.weight; gemma3 -> gemma3_text; the vocabulary's size where no key gives it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = header.arch
    named = arch
    if "llama" in arch and header.fields.get("general.name") == "mistral":  # (transformers' test, as it is)
        named = "mistral"
    out: dict = {"tie_word_embeddings": "output.weight" not in header.tensors}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(named) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        out.setdefault(key, value)
    for key, value in header.fields.items():
        key = key.replace(arch, named)
        prefix, _, rest = key.partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, named)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            out[renamed] = value
    if out.get("model_type") == "gemma3":
        out["model_type"] = "gemma3_text"
    if "vocab_size" not in out and vocab_size is not None:
        out["vocab_size"] = vocab_size
    return out


def header_config(header: Header) -> dict | None:
    """A held architecture's transformers config made from its header read without arrays (what the planner
    needs, without converting the file): what the converted folder's config.json holds (config_and_tokenizer
    in engine.model.gguf_convert), its vocabulary's size taken from the embedding's rows (the tokens' array is
    skipped). None where the header alone does not give it: an architecture transformers' own reader converts,
    no embedding, a config key whose value is an array the header skipped, or a config transformers refuses."""
    embedding = header.tensors.get("token_embd.weight")
    if not held_architecture(header.arch) or embedding is None or len(embedding.ne) != 2:
        return None
    made = config_dict(header, embedding.ne[1])
    if any(value is None for value in made.values()):
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**made).to_dict()
    except (ValueError, KeyError, TypeError):
        return None


def gemma_merges(tokens: list[str]) -> list[str]:
    """The merges transformers derives for a Gemma vocabulary (gguf_tokenizer_mapping.gemma_tokenizer, by
    tokenization_utils_base.generate_merges), as "left right" strings: every split of a token into two
    tokens, the tokens in the order of their (last) position in the vocabulary, a token's splits longest
    left part first. tokens: the vocabulary as that builder respells it (no token holds a space)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    words = [tokens[i] for i in sorted(vocab.values())]
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    which, cuts = [], []
    for k in range(1, int(lengths.max(initial=0))):
        longer = np.nonzero(lengths > k)[0]
        hit = np.fromiter((w[:k] in vocab and w[k:] in vocab for w in map(words.__getitem__, longer.tolist())),
                          dtype=bool, count=len(longer))
        which.append(longer[hit])
        cuts.append(np.full(int(hit.sum()), k))
    if not which:
        return []
    which, cuts = np.concatenate(which), np.concatenate(cuts)
    order = np.lexsort((-cuts, which))
    return [f"{words[i][:k]} {words[i][k:]}" for i, k in zip(which[order].tolist(), cuts[order].tolist())]


def gguf_tokenizer(header: Header):
    """A Gemma GGUF's tokenizer as AutoTokenizer.from_pretrained(gguf_file=..., tokenizer_type=...) builds it
    (GemmaTokenizer around transformers' convert_gguf_tokenizer of the file's vocabulary), the merges from
    gemma_merges. header: read with arrays."""
    from transformers import GemmaTokenizer
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = header.fields
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, settings = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        settings.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        settings[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokenizer["tokens"]]
    if "merges" not in tokenizer and not any(" " in t for t in respelled):
        tokenizer["merges"] = gemma_merges(respelled)
    backend, extra = convert_gguf_tokenizer(header.arch, tokenizer)
    return GemmaTokenizer(tokenizer_object=Given(backend), **settings, **extra)


class Given:
    """A built backend handed to a transformers tokenizer as its tokenizer_object, which it deep-copies: the
    copy is the backend itself (a 262k-token BPE: 1.6 s to copy for nothing, the original being dropped)."""

    def __init__(self, backend):
        self.backend = backend

    def __deepcopy__(self, memo):
        return self.backend
