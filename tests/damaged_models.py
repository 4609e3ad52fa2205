"""A corpus of damaged model files, written small into a folder (tests/test_damaged_models.py runs the CLI on
each under a memory limit): safetensors of random bytes, truncated at several offsets, with headers that lie
about sizes, offsets or dtypes; config.json files that do not match the weights or are not JSON; a missing
tensor; an empty folder; GGUFs of random bytes, truncated in their header, tensor table and data, with an
unknown block type, a tensor past the end of the file, and counts or lengths that would ask for terabytes."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np


def safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def folder_cases(good: Path, root: Path) -> dict[str, Path]:
    """name -> a damaged copy of the model folder `good` (config.json, model.safetensors, tokenizer)."""
    cases: dict[str, Path] = {}

    def copy(name: str) -> Path:
        out = root / name
        shutil.copytree(good, out)
        cases[name] = out
        return out

    weights = good / "model.safetensors"
    raw = weights.read_bytes()
    header, data = safetensors_parts(weights)
    n_header = struct.unpack("<Q", raw[:8])[0]
    rng = np.random.default_rng(0)
    copy("random-bytes")
    (cases["random-bytes"] / "model.safetensors").write_bytes(rng.integers(0, 256, len(raw), np.uint8).tobytes())
    for cut in (0, 5, 8 + n_header // 2, 8 + n_header, 8 + n_header + len(data) // 2, len(raw) - 1):
        (copy(f"truncated-at-{cut}") / "model.safetensors").write_bytes(raw[:cut])
    names = [k for k in header if k != "__metadata__"]
    big = max(names, key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])

    def lying(name: str, change) -> None:
        h = json.loads(json.dumps(header))
        change(h)
        write_safetensors(copy(name) / "model.safetensors", h, data)

    lying("header-shape-larger-than-data", lambda h: h[big].update(shape=[s * 2 for s in h[big]["shape"]]))
    lying("header-offsets-past-end", lambda h: h[big].update(data_offsets=[0, len(data) * 4]))
    lying("header-dtype-f64", lambda h: h[big].update(dtype="F64"))
    lying("header-dtype-unknown", lambda h: h[big].update(dtype="Q9"))
    kept, parts, at = {}, [], 0  # a well-formed file without the largest tensor
    for k in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
        if k != big:
            b, e = header[k]["data_offsets"]
            kept[k] = {**header[k], "data_offsets": [at, at + e - b]}
            parts.append(data[b:e])
            at += e - b
    write_safetensors(copy("missing-tensor") / "model.safetensors", kept, b"".join(parts))
    write_safetensors(copy("header-drops-a-tensor") / "model.safetensors",  # its bytes left unaccounted for
                      {k: v for k, v in header.items() if k != big}, data)
    (copy("huge-header-length") / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    config = json.loads((good / "config.json").read_text())

    def changed(**values) -> str:  # (a multimodal config's text model sizes are in its text_config)
        out = json.loads(json.dumps(config))
        (out["text_config"] if "text_config" in out else out).update(values)
        return json.dumps(out)

    text = config.get("text_config") or config
    (copy("config-wrong-sizes") / "config.json").write_text(changed(intermediate_size=96))
    (copy("config-wrong-hidden") / "config.json").write_text(changed(hidden_size=text["hidden_size"] * 2))
    (copy("config-more-layers") / "config.json").write_text(changed(num_hidden_layers=text["num_hidden_layers"] + 3))
    (copy("config-not-json") / "config.json").write_text("{ this is not json")
    (copy("config-huge-vocab") / "config.json").write_text(changed(vocab_size=1 << 40))
    out = root / "empty-folder"
    out.mkdir()
    cases["empty-folder"] = out
    return cases


def write_tiny_gguf(path: Path, kind=gguf.GGMLQuantizationType.Q8_0) -> Path:
    """A small llama GGUF (the gguf package's writer) with a word-piece vocabulary: readable, loadable."""
    w = gguf.GGUFWriter(str(path), "llama")
    hidden, layers, vocab = 64, 1, 64
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>", "▁", "w", *"0123456789", "▁w"]
    tokens += [f"▁w{i}" for i in range(vocab - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    rng = np.random.default_rng(0)

    def add(name: str, rows: int, k: int) -> None:
        x = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    add("token_embd.weight", vocab, hidden)
    for p in ("blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.0.attn_output"):
        add(p + ".weight", hidden, hidden)
    add("blk.0.ffn_gate.weight", 128, hidden)
    add("blk.0.ffn_up.weight", 128, hidden)
    add("blk.0.ffn_down.weight", hidden, 128)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_cases(good: Path, root: Path) -> dict[str, Path]:
    """name -> a damaged copy of the GGUF file `good`."""
    raw = good.read_bytes()
    reader = gguf.GGUFReader(good)
    first = min(reader.tensors, key=lambda t: t.data_offset)
    start = first.data_offset  # the tensor data begins here
    info_at = raw.index(first.name.encode()) - 8  # the first tensor-table entry (its name's length)
    cases: dict[str, bytes] = {"random-bytes": b"GGUF" + np.random.default_rng(1).integers(
        0, 256, len(raw) - 4, np.uint8).tobytes()}
    for cut in (3, 12, 100, info_at + 4, start - 1, start + (len(raw) - start) // 2, len(raw) - 1):
        cases[f"truncated-at-{cut}"] = raw[:cut]
    entry = info_at + 8 + len(first.name.encode())  # n_dims (u32), dims (u64 each), type (u32), offset (u64)
    n_dims = struct.unpack_from("<I", raw, entry)[0]
    type_at = entry + 4 + 8 * n_dims
    cases["unknown-block-type"] = raw[:type_at] + struct.pack("<I", 99) + raw[type_at + 4:]
    cases["tensor-past-end"] = raw[:type_at + 4] + struct.pack("<Q", 1 << 40) + raw[type_at + 12:]
    cases["dims-lie"] = raw[:entry + 4] + struct.pack("<Q", 1 << 33) + raw[entry + 12:]
    cases["huge-tensor-count"] = raw[:8] + struct.pack("<Q", 1 << 50) + raw[16:]
    cases["huge-key-length"] = raw[:24] + struct.pack("<Q", 1 << 50) + raw[32:]
    out = {}
    for name, data in cases.items():
        path = root / f"{name}.gguf"
        path.write_bytes(data)
        out[name] = path
    return out
