"""A stored document read in place (format specache-kv-2, engine/docstore/entries.py): a hit maps the entry's
exact rows into the host store (engine/backends/host_pages.py, HostStore.place_row) instead of reading them.
A mapped hit gives the tokens of a fresh prefill; the store's rows are the file's pages, not a copy; nothing
written after the load reaches the file; a damaged or truncated entry is reported, deleted and rebuilt; an
interrupted write leaves no entry; an entry of the format before (specache-kv-1) is still read.

Every test that can touch the store points SPECACHE_CACHE_DIR at its own tmp folder."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.backends import host_pages
from engine.backends.host_pages import PAGE, MappedFile, PlacedPages
from engine.config import CacheConfig, GenerationConfig
from engine.docstore import entries
from engine.docstore import store as S
from engine.docstore.store import DocStore
from engine.generate.engine import Engine, Finished
from engine.generate.prefixes import DocStoreUse
from engine.backends.host_mapping import mapped_zeros
from tests.test_store import Warnings, own_cache_dir, prompt_ids  # noqa: F401 (own_cache_dir: autouse, a tmp store)

DATA = Path(__file__).parent / "data"
GEN = GenerationConfig(max_tokens=12)


def run(model, config, use, doc, question):
    """One generate over doc + question (the document as the prefix) -> Finished."""
    events = list(Engine(model, config, use).generate([doc + question], GEN, prefixes=[len(doc)], labels=["doc"]))
    assert isinstance(events[-1], Finished)
    return events[-1]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of path (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(" " + str(path)):
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def rss_anon() -> int:
    """This process's resident anonymous memory, bytes (what a copied-in store would take)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


# ---- a hit maps, and gives the tokens of a fresh prefill -------------------------------------------

@pytest.mark.parametrize("mode", ["specache", "exact"])
def test_a_mapped_hit_gives_the_tokens_of_a_fresh_prefill(tiny_model, tmp_path, mode):
    config = CacheConfig(mode=mode, k=16, group=32, residual=16, chunk_size=64, gamma=4 if mode == "exact" else None)
    use = DocStoreUse(DocStore(tmp_path / "kv"), "tiny")
    doc, question = prompt_ids(300, 5), prompt_ids(9, 6)
    plain = run(tiny_model, config, None, doc, question)
    miss = run(tiny_model, config, use, doc, question)
    path = use.store.path(miss.store[0]["key"])
    assert entries.read_header(path)[1]["format"] == "specache-kv-2"
    hits = [run(tiny_model, config, use, doc, question) for _ in range(2)]  # loaded twice
    assert all(h.store[0]["hit"] for h in hits) and "host_mapped_bytes" not in miss.cache_stats
    assert plain.tokens == miss.tokens == hits[0].tokens == hits[1].tokens
    layers, heads = tiny_model.config.num_hidden_layers, tiny_model.config.num_key_value_heads
    head_dim = tiny_model.config.hidden_size // tiny_model.config.num_attention_heads
    table = entries.read_header(path)[0]
    size = {"F32": 4, "BF16": 2, "F16": 2}[table["layers.0.store_k"]["dtype"]]  # (the store's element type)
    rows = -(-300 * head_dim * size // PAGE) * PAGE  # each head's 300 rows, to whole pages
    assert hits[0].cache_stats["host_mapped_bytes"] == 2 * layers * heads * rows
    assert 0 < hits[0].cache_stats["host_mapped_resident_bytes"] <= hits[0].cache_stats["host_mapped_bytes"]


def test_questions_sharing_a_stored_document_each_map_it(tiny_model, tmp_path):
    """Several questions on one stored document (one batch, a shared prefix): every row maps the entry's rows
    (the pages shared), none copies row 0's; the tokens are those of each question alone."""
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    use = DocStoreUse(DocStore(tmp_path / "kv"), "tiny")
    doc, questions = prompt_ids(280, 51), [prompt_ids(n, 52 + n) for n in (6, 9, 12)]
    alone = [run(tiny_model, config, use, doc, q) for q in questions]  # (the first stores the document)
    events = list(Engine(tiny_model, config, use).generate([doc + q for q in questions], GEN, shared_prefix=280))
    both = events[-1]
    assert all(info["hit"] for info in both.store) and both.tokens == [a.tokens[0] for a in alone]
    assert both.cache_stats["host_mapped_bytes"] == 3 * alone[1].cache_stats["host_mapped_bytes"]


def test_ask_with_the_store_equals_no_store(tiny_model_dir, own_cache_dir):
    from specache_cli.app import app

    runner = CliRunner()
    args = ["ask", "--model", str(tiny_model_dir), "--quiet", "--doc", str(DATA / "sample.txt"), "What is it about?",
            "--max-tokens", "8", "--json", "--cache", "specache"]
    outs = [json.loads(runner.invoke(app, args + extra, catch_exceptions=False).stdout) for extra in
            (["--no-store"], [], [], [])]
    assert outs[0]["store"] is None and outs[1]["store"]["hit"] is False
    assert outs[2]["store"]["hit"] and outs[3]["store"]["hit"]
    assert len({o["text"] for o in outs}) == 1
    assert "host_mapped_bytes" not in outs[0]["cache"] and outs[3]["cache"]["host_mapped_bytes"] > 0


# ---- the rows are the file's pages --------------------------------------------------------------

def stored_entry(tmp_path, n=1000, heads=3, dim=64):
    """A store holding one entry with a paged tensor "store_k" [heads, n, dim] fp32 (and a small one)."""
    store = DocStore(tmp_path / "kv")
    rows = torch.randn(heads, n + 100, dim)[:, :n]  # a view, as a host store's row is
    key = S.make_key({"model": "m"}, [1, 2, 3])
    store.save(key, [1, 2, 3], {"store_k": rows, "qend": torch.tensor([64])}, paged=["store_k"])
    return store, key, rows


def test_a_paged_entry_is_standard_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    store, key, rows = stored_entry(tmp_path)
    other = load_file(store.path(key))  # any safetensors reader: the padded shape, zero rows after n
    heads, n, dim = rows.shape
    assert other["store_k"].shape[1] > n and torch.equal(other["store_k"][:, :n], rows)
    assert not other["store_k"][:, n:].any() and other["qend"].tolist() == [64]
    with safe_open(str(store.path(key)), "pt") as f:
        assert json.loads(f.metadata()["specache"])["paged"] == {"store_k": n}


def test_placed_rows_are_the_file_s_pages(tmp_path):
    store, key, rows = stored_entry(tmp_path, n=20000)
    loaded = store.load(key, [1, 2, 3])
    assert loaded.meta["paged"] == {"store_k": 20000}
    heads, n, dim = rows.shape
    dst, _mapping = mapped_zeros((2, heads, host_pages.paged_length(24000, dim * 4), dim), torch.float32)
    placed = PlacedPages()
    before = rss_anon()
    assert loaded.pages.place(loaded.tensors["store_k"], dst[1], placed)
    loaded.close()
    total = float(dst[1, :, :n].sum())  # every stored row read: from the page cache, not copied in (15 MB)
    assert rss_anon() - before < rows.numel() * 4 // 4
    assert total == pytest.approx(float(rows.sum()), rel=1e-4, abs=1e-2)
    assert torch.equal(dst[1, :, :n], rows) and not dst[1, :, n:].any() and not dst[0].any()
    maps = file_mappings(store.path(key))
    for h in range(heads):  # every head's rows lie in a mapping of the entry itself
        lo = dst[1, h].data_ptr()
        assert any(a <= lo and lo + n * dim * 4 <= b for a, b in maps)
    assert placed.nbytes == heads * -(-n * dim * 4 // PAGE) * PAGE and placed.resident() == placed.nbytes


def file_rss(path: Path, within: torch.Tensor) -> int:
    """Bytes of path's pages in this process's memory inside within's memory (/proc/self/smaps: Rss of the
    mappings of path there)."""
    lo = within.data_ptr()
    hi = lo + within.numel() * within.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            inside = line.endswith(" " + str(path)) and lo <= a and b <= hi
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_released_rows_leave_the_process_and_read_the_same(tmp_path):
    """PlacedPages.release drops the placed pages this process holds (the question's prefill over a stored
    document, HostStore.unmap_read): they read the file's bytes again afterwards; a page written since (a
    private copy) is kept, with what was written."""
    store, key, rows = stored_entry(tmp_path, n=8000)
    loaded = store.load(key, [1, 2, 3])
    heads, n, dim = rows.shape
    dst, _mapping = mapped_zeros((1, heads, host_pages.paged_length(9000, dim * 4), dim), torch.float32)
    placed = PlacedPages()
    assert loaded.pages.place(loaded.tensors["store_k"], dst[0], placed)
    loaded.close()
    path, nbytes = store.path(key), heads * n * dim * 4
    assert torch.equal(dst[0, :, :n], rows) and file_rss(path, dst[0]) >= nbytes  # every row read: resident
    dst[0, 1, :5] = 7.0  # one page of head 1 written: a private copy
    released = placed.release(dst[0])
    assert nbytes - 2 * PAGE <= released <= placed.nbytes - PAGE
    assert file_rss(path, dst[0]) == PAGE  # the written page only
    assert placed.release(dst[1:]) == 0  # (nothing placed there)
    assert (dst[0, 1, :5] == 7).all() and torch.equal(dst[0, 1, 5:n], rows[1, 5:])
    assert torch.equal(dst[0, 0, :n], rows[0]) and torch.equal(dst[0, 2, :n], rows[2])


def test_a_mapped_hit_releases_the_rows_its_question_read(tiny_model, tmp_path, monkeypatch):
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    use = DocStoreUse(DocStore(tmp_path / "kv"), "tiny")
    doc, question = prompt_ids(900, 41), prompt_ids(9, 42)
    miss = run(tiny_model, config, use, doc, question)
    released, original = [], PlacedPages.release
    monkeypatch.setattr(PlacedPages, "release", lambda self, within: released.append(original(self, within))
                        or released[-1])
    hit = run(tiny_model, config, use, doc, question)
    assert hit.store[0]["hit"] and hit.tokens == miss.tokens
    assert sum(released) >= hit.cache_stats["host_mapped_bytes"] // 2  # (all but pages written since)


def test_writes_into_placed_rows_never_reach_the_file(tmp_path):
    store, key, rows = stored_entry(tmp_path)
    path, before = store.path(key), digest(store.path(key))
    loaded = store.load(key, [1, 2, 3])
    heads, n, dim = rows.shape
    dst, _mapping = mapped_zeros((1, heads, host_pages.paged_length(2000, dim * 4), dim), torch.float32)
    assert loaded.pages.place(loaded.tensors["store_k"], dst[0], PlacedPages())
    dst[0, :, :10] = 7.0  # a stored position rewritten
    dst[0, :, n : n + 50] = 3.0  # positions after the stored prefix (the question, the decode)
    assert digest(path) == before
    assert torch.equal(dst[0, :, 10:n], rows[:, 10:]) and (dst[0, :, :10] == 7).all()
    again = store.load(key, [1, 2, 3])
    assert torch.equal(again.tensors["store_k"], rows)


def test_a_generation_from_a_mapped_entry_leaves_it_unchanged(tiny_model, tmp_path):
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    use = DocStoreUse(DocStore(tmp_path / "kv"), "tiny")
    doc = prompt_ids(260, 11)
    miss = run(tiny_model, config, use, doc, prompt_ids(7, 12))
    path = use.store.path(miss.store[0]["key"])
    before = digest(path)
    for seed in (13, 14):  # questions and decodes write the store after the stored prefix
        assert run(tiny_model, config, use, doc, prompt_ids(70, seed)).store[0]["hit"]
    assert digest(path) == before
    full = entries.parse(bytearray(path.read_bytes()), verify=True)[1]  # every CRC, the exact rows' too
    assert full["paged"] and all(name in full["crc32"] for name in full["paged"])


def test_rows_that_cannot_be_placed_are_copied(tiny_model, tmp_path, monkeypatch):
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    use = DocStoreUse(DocStore(tmp_path / "kv"), "tiny")
    doc, question = prompt_ids(200, 21), prompt_ids(8, 22)
    miss = run(tiny_model, config, use, doc, question)
    monkeypatch.setattr(MappedFile, "_spans", lambda self, src, dst: None)  # e.g. another page size, not Linux
    hit = run(tiny_model, config, use, doc, question)
    assert hit.store[0]["hit"] and hit.tokens == miss.tokens and "host_mapped_bytes" not in hit.cache_stats


# ---- damaged entries, interrupted writes, the format before ----------------------------------------

@pytest.mark.parametrize("damage", ["truncate-rows", "truncate-tail", "flip-guide", "header"])
def test_a_damaged_entry_is_reported_deleted_and_rebuilt(tiny_model, tmp_path, damage):
    warn = Warnings()
    use = DocStoreUse(DocStore(tmp_path / "kv", warn=warn), "tiny")
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    doc, question = prompt_ids(240, 31), prompt_ids(6, 32)
    first = run(tiny_model, config, use, doc, question)
    path = use.store.path(first.store[0]["key"])
    data = bytearray(path.read_bytes())
    if damage == "truncate-rows":  # cut inside the exact rows (which a load does not read)
        data = data[: len(data) // 3]
    elif damage == "truncate-tail":
        data = data[:-1]
    elif damage == "flip-guide":  # the small tensors after the rows are checksummed on a load
        data[len(data) - 100] ^= 0xFF
    else:
        data[12:20] = b"garbage!"
    path.write_bytes(bytes(data))
    again = run(tiny_model, config, use, doc, question)
    assert again.store[0]["hit"] is False and again.tokens == first.tokens
    assert len(warn) == 1 and "corrupt" in warn[0] and first.store[0]["key"][:12] in warn[0]
    third = run(tiny_model, config, use, doc, question)  # rebuilt by the run that found it
    assert third.store[0]["hit"] is True and third.tokens == first.tokens


def test_an_interrupted_write_leaves_no_entry(tmp_path, monkeypatch):
    store = DocStore(tmp_path / "kv")
    real = S.write

    def interrupted(path, tensors, meta, on_piece=None):
        calls = []

        def boom():  # in the middle of the paged rows
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt

        return real(path, tensors, meta, on_piece=boom)

    monkeypatch.setattr(S, "write", interrupted)
    key = S.make_key({"model": "m"}, [1, 2, 3])
    with pytest.raises(KeyboardInterrupt):
        store.save(key, [1, 2, 3], {"store_k": torch.randn(3, 900, 64)}, paged=["store_k"])
    assert list(store.root.iterdir()) in ([], [store.root / ".lock"])
    assert store.load(key, [1, 2, 3]) is None and store.entries() == []


def test_an_entry_of_the_format_before_is_still_read(tiny_model, tmp_path, monkeypatch):
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    use = DocStoreUse(DocStore(tmp_path / "kv"), "tiny")
    doc, question = prompt_ids(220, 41), prompt_ids(7, 42)
    with monkeypatch.context() as m:
        m.setattr(S, "FORMAT", "specache-kv-1")  # the writer before: no paged rows
        m.setattr(S.DocStore, "save", _save_unpaged(S.DocStore.save))
        miss = run(tiny_model, config, use, doc, question)
    header = entries.read_header(use.store.path(miss.store[0]["key"]))[1]
    assert header["format"] == "specache-kv-1" and "paged" not in header
    hit = run(tiny_model, config, use, doc, question)
    assert hit.store[0]["hit"] and hit.store[0]["key"] == miss.store[0]["key"] and hit.tokens == miss.tokens
    assert "host_mapped_bytes" not in hit.cache_stats  # its rows copied in, as before


def _save_unpaged(save):
    return lambda self, key, ids, tensors, meta=None, paged=(): save(self, key, ids, tensors, meta)


def test_cache_verify_finds_a_bit_flipped_in_the_exact_rows_a_load_does_not_read(tmp_path, own_cache_dir):
    """A load maps the exact rows unread, so a bit flipped there after writing loads; `specache cache verify`
    reads every byte, reports the entry damaged and removes it, and leaves a whole entry alone."""
    from specache_cli.app import app

    store, key, rows = stored_entry(own_cache_dir)  # the CLI's store folder, own_cache_dir / "kv"
    assert store.root == S.store_dir()
    whole = S.make_key({"model": "m"}, [4, 5])
    store.save(whole, [4, 5], {"store_k": rows, "qend": torch.tensor([8])}, paged=["store_k"])
    path = store.path(key)
    data = bytearray(path.read_bytes())
    start = data.find(rows[1, 7].numpy().tobytes())  # inside the paged rows
    assert start > 0
    data[start] ^= 0x01
    path.write_bytes(bytes(data))
    loaded = store.load(key, [1, 2, 3])
    assert loaded is not None  # the trade-off: a load does not see it
    del loaded
    r = CliRunner().invoke(app, ["cache", "verify", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["checked"], out["damaged"]) == (2, 1)
    damage = {e["key"]: e["damage"] for e in out["entries"]}
    assert damage[whole] is None and "checksum mismatch" in damage[key] and "store_k" in damage[key]
    assert [e["removed"] for e in out["entries"] if e["key"] == key] == [True]
    assert not path.exists() and store.path(whole).exists()
    r = CliRunner().invoke(app, ["cache", "verify", whole[:8]])
    assert r.exit_code == 0 and "1 checked, 0 damaged, 0 removed" in r.stdout and "[1/1] checking" in r.stderr
    r = CliRunner().invoke(app, ["cache", "verify", "ffffffff"])
    assert r.exit_code == 3 and "error: no store entry" in r.stderr
