"""Exact mode (engine/kvcache/policies/exact.py, engine.generate.steps.exact_cycles): the guided cache drafts,
one exact pass verifies, so greedy output is the full cache's (transformers' DynamicCache) token for
token whatever the draft does, the cache after a cycle holds exactly what a cache that only saw the
accepted tokens holds, and sampling draws from the full cache's distribution."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, GenerationConfig
from engine.errors import BadArgument
from engine.generate import exact_steps, steps
from engine.generate.engine import Engine
from engine.generate.sampling import Sampler
from engine.generate.steps import exact_cycles, greedy
from tests.test_engine import dynamic_cache_greedy, prompts_of, run

NEW = 24
TINY = {"k": 16, "residual": 32, "group": 32, "sinks": 4}  # a small fetched set: the draft is often wrong


@pytest.fixture(scope="module")
def reference(tiny_model):
    ps = prompts_of((150, 97, 260))
    return ps, [dynamic_cache_greedy(tiny_model, p) for p in ps]


@pytest.mark.parametrize("bits,gamma,chunk", [(1, 1, 64), (2, 4, 16), (1, 16, 512), (2, None, 64)])
def test_greedy_exact_equals_dynamic_cache(tiny_model, reference, bits, gamma, chunk):
    ps, refs = reference
    res = run(tiny_model, ps, CacheConfig(mode="exact", bits=bits, gamma=gamma, chunk_size=chunk, **TINY))
    assert res.tokens == refs
    stats = res.cache_stats
    assert stats["mode"] == "exact" and stats["gamma"] == (gamma if gamma else "auto")
    assert 0 < stats["acceptance_rate"] < 1  # the draft is neither always right nor always wrong here
    assert 1 < stats["tokens_per_verify"] <= (gamma or 16) + 1


def forced_draft(monkeypatch, sequences: list[list[int]], wrong: bool, vocab: int) -> None:
    """Make every draft pass predict sequences[r][next position] (+1 when wrong) for row r."""
    real = exact_steps.draft_logits

    def fake(model, cache, ids, rows):
        lengths = cache.lengths[rows].tolist()
        logits = real(model, cache, ids, rows)
        out = torch.zeros_like(logits)
        for r, n in enumerate(lengths):
            seq = sequences[r]
            token = seq[n + 1] if n + 1 < len(seq) else 0
            out[r, (token + int(wrong)) % vocab] = 1.0
        return out

    monkeypatch.setattr(exact_steps, "draft_logits", fake)


@pytest.mark.parametrize("wrong", [True, False])
def test_forced_draft_keeps_the_output_exact(tiny_model, reference, monkeypatch, wrong):
    ps, refs = reference
    longer = [dynamic_cache_greedy(tiny_model, p, NEW + 20) for p in ps]  # drafts may look past NEW
    forced_draft(monkeypatch, [p + r for p, r in zip(ps, longer)], wrong, tiny_model.config.vocab_size)
    gamma = 2 if wrong else 4
    res = run(tiny_model, ps, CacheConfig(mode="exact", gamma=gamma, chunk_size=64, **TINY))
    assert res.tokens == refs
    assert res.cache_stats["acceptance_rate"] == (0.0 if wrong else 1.0)
    assert res.cache_stats["tokens_per_verify"] == (1.0 if wrong else gamma + 1)


def test_a_finished_row_leaves_the_batch_while_the_others_go_on(tiny_model, reference, monkeypatch):
    """Row 1 of 3 stops early: its slot takes row 2's state (drop_finished) and the passes after it
    verify 2 rows; the outputs stay the full cache's."""
    ps, refs = reference
    stop = refs[1][5]  # row 1 stops early; the others go on to NEW tokens (or their own stop)
    # (with processors that read each row's answer so far: they must follow the rows that move)
    gen = GenerationConfig(max_tokens=NEW, stop_ids=(stop,), no_repeat_ngram=2, repeat_penalty=1.3)
    full = run(tiny_model, ps, CacheConfig(mode="full", chunk_size=64), gen)
    fed = []
    real = exact_steps.forward
    monkeypatch.setattr(exact_steps, "forward", lambda model, cache, ids, rows, **kw: (kw["how"].exact and fed.append(
        ids.shape[0])) or real(model, cache, ids, rows, **kw))  # rows fed to each verification
    exact = run(tiny_model, ps, CacheConfig(mode="exact", gamma=4, chunk_size=64, **TINY), gen)
    assert exact.tokens == full.tokens
    assert len(full.tokens[1]) < NEW and max(map(len, full.tokens)) == NEW
    assert fed[0] == 3 and fed[-1] < 3 and fed == sorted(fed, reverse=True)  # rows only ever leave


def test_drop_finished_moves_live_rows_into_freed_slots(tiny_model):
    """Slots 0 and 2 of 4 finish: slot 3 moves into slot 0, slot 1 stays; the moved row's whole state
    is what it was."""
    ps = prompts_of((40, 50, 60, 70))
    engine = Engine(tiny_model, CacheConfig(mode="exact", chunk_size=32, **TINY))
    with engine.new_cache(4, 120) as cache:
        for r, p in enumerate(ps):
            list(engine.prefill(cache, p, r))
        before = [state(cache, r) for r in range(4)]
        assert steps.drop_finished(cache, [0, 1, 2, 3], None) == [0, 1, 2, 3]
        assert steps.drop_finished(cache, [0, 1, 2, 3], [False] * 4) == [0, 1, 2, 3]
        source = steps.drop_finished(cache, [0, 1, 2, 3], [True, False, True, False])
        assert source == [3, 1]
        for slot, old in enumerate(source):
            now = state(cache, slot)
            assert now.keys() == before[old].keys()
            assert all(torch.equal(now[n], before[old][n]) for n in now)
        assert steps.drop_finished(cache, [5, 7], [True] * 8) == []


def state(cache, row: int) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in cache.export_row(row).items()}


@pytest.mark.parametrize("in_store", [True, False], ids=["cpu-layout", "cuda-layout"])
def test_draft_passes_never_write_the_host_store(tiny_model, monkeypatch, in_store):
    """Drafts move only the lengths (and the residual window): the committed part of the exact store is bit
    for bit what it was, and rollback restores the lengths. Where the residual window has buffers of its
    own (CUDA) the store is untouched whole; on the CPU the window is the store's memory, so the drafts'
    K/V land past the committed length, where the verification rewrites them."""
    import engine.kvcache
    from engine.kvcache.transfer import Transfer

    if not in_store:
        monkeypatch.setattr(engine.kvcache, "Transfer", lambda device: Transfer(device, residual_in_store=False))
    ps = prompts_of((70, 45), seed=5)
    eng = Engine(tiny_model, CacheConfig(mode="exact", chunk_size=32, **TINY))
    with eng.new_cache(2, 120) as cache:
        lasts = [list(eng.prefill(cache, p, r))[-1] for r, p in enumerate(ps)]
        stores = [(layer.store.k.clone(), layer.store.v.clone()) for layer in cache.layers]
        committed = cache.lengths.clone()
        drafts, _ = steps._draft(tiny_model, cache, torch.stack(lasts).argmax(-1), 5, [list(p) for p in ps], None)
        assert drafts.shape == (2, 5) and torch.equal(cache.lengths, committed + 5)
        for layer, (k, v) in zip(cache.layers, stores):
            assert layer.res_in_store == in_store
            for r, n in enumerate(committed.tolist()):
                assert torch.equal(layer.store.k[r, :, :n], k[r, :, :n]) and torch.equal(layer.store.v[r, :, :n], v[r, :, :n])
            assert torch.equal(layer.store.k, k) != in_store  # the CPU layout wrote the drafts past it
        cache.rollback(slice(0, 2), committed)
        assert torch.equal(cache.lengths, committed)


def test_a_rejected_cycle_leaves_the_cache_of_the_accepted_tokens(tiny_model, monkeypatch):
    """Row 0 (95 tokens: its accepted tokens move the quantization boundary) accepts 2 of 4 drafts,
    row 1 none. Every tensor of each row's state (host store, guide codes and scales, sinks,
    residual, qend, length) equals that of a cache that never drafted: one exact pass of the same
    tokens committing the same counts (bit for bit), and row by row passes of only the accepted
    tokens (integers equal, K/V to float rounding: the linears' sums run in another order for
    another number of tokens)."""
    ps = prompts_of((95, 60), seed=3)
    config = CacheConfig(mode="exact", gamma=4, chunk_size=64, bits=1, **TINY)
    engine = Engine(tiny_model, config)
    refs = [dynamic_cache_greedy(tiny_model, p, 8) for p in ps]
    vocab = tiny_model.config.vocab_size
    good = [2, 0]  # drafts right before the first wrong one, per row
    fed = [[refs[r][0]] + [refs[r][1 + j] if j < good[r] else (refs[r][1 + j] + 1) % vocab for j in range(4)]
           for r in range(2)]  # [t0, d1..d4] of the cycle
    real = exact_steps.draft_logits
    calls = {"n": 0}

    def fake(model, cache, ids, rows):
        logits = real(model, cache, ids, rows)
        out = torch.zeros_like(logits)
        for r in range(2):
            out[r, fed[r][1 + calls["n"]]] = 1.0
        calls["n"] += 1
        return out

    def exact_pass(cache, rows: slice, ids: list[list[int]], kept: list[int]) -> None:
        step = cache.begin(rows, len(ids[0]), exact=True)
        with torch.inference_mode():
            tiny_model(input_ids=torch.tensor(ids), position_ids=step.positions(), cache=cache, use_cache=True,
                       kv_cache=cache)
        cache.commit(kept=torch.tensor(kept))

    monkeypatch.setattr(exact_steps, "draft_logits", fake)
    caches = [engine.new_cache(2, 200) for _ in range(3)]
    try:
        cache, same_pass, per_row = caches
        lasts = [list(engine.prefill(cache, p, r))[-1] for r, p in enumerate(ps)]
        for ref in (same_pass, per_row):
            for r, p in enumerate(ps):
                list(engine.prefill(ref, p, r))
        cycles = exact_cycles(tiny_model, cache, torch.stack(lasts), greedy, history=ps)
        first, _ = next(cycles)
        emitted, _ = next(cycles)
        assert calls["n"] == 4
        assert [e[0] for e in first] == [r[0] for r in refs]
        assert emitted == [refs[0][1:4], refs[1][1:2]]  # 2 drafts + the exact token / the exact token
        assert cache.lengths.tolist() == [95 + 3, 60 + 1]  # t0 and the accepted drafts
        assert int(cache.layers[0].qend[0]) == 64 > quant_before(95)  # the boundary did move
        exact_pass(same_pass, slice(0, 2), fed, [good[0] + 1, good[1] + 1])
        for r in range(2):
            exact_pass(per_row, slice(r, r + 1), [fed[r][: good[r] + 1]], [good[r] + 1])
        for r in range(2):
            got, want, near = state(cache, r), state(same_pass, r), state(per_row, r)
            assert got.keys() == want.keys() == near.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), f"row {r}: {name}"
                if got[name].is_floating_point() and "scale" not in name and "zero" not in name:
                    torch.testing.assert_close(got[name], near[name], rtol=0, atol=1e-5)
                else:
                    assert torch.equal(got[name], near[name]), f"row {r}: {name}"
    finally:
        for c in caches:
            c.close()


def quant_before(length: int) -> int:
    from engine.kvcache.sizes import quant_boundary

    return int(quant_boundary(torch.tensor(length), TINY["residual"], TINY["group"]))


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit, cells with an expected count under 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_speculative_sampling_rule_draws_from_the_exact_distribution():
    """_accept with a Sampler (temperature 1.3, top-p 0.9) on 4000 rows whose drafts come from a
    draft distribution q far from the exact p: the first new token of each row, and the second of
    the rows that accepted their first draft, are distributed as the exact p of their position
    (chi-square, fixed seeds), and about as often accepted as sum(min(p, q)) says."""
    torch.manual_seed(0)
    b, g, v = 4000, 2, 8
    gen = GenerationConfig(temperature=1.3, top_p=0.9, seed=3)
    sampler = Sampler(gen, torch.device("cpu"))
    exact = (torch.randn(1, g + 1, v) * 2).expand(b, -1, -1)  # [B, g + 1, V] the verification's logits
    draft = (torch.randn(1, g, v) * 2).expand(b, -1, -1)
    hist = [[1, 2, 3] for _ in range(b)]
    q = torch.stack([sampler.probs(draft[:, i], hist) for i in range(g)], 1)  # [B, g, V]
    drafts = torch.stack([torch.multinomial(q[:, i], 1, generator=torch.Generator().manual_seed(i)).squeeze(1)
                          for i in range(g)], 1)
    n_acc, new = steps._accept(sampler, exact, drafts, q, hist)
    first = [int(drafts[r, 0]) if n_acc[r] else new[r] for r in range(b)]
    second = [int(drafts[r, 1]) if n_acc[r] > 1 else new[r] for r in range(b) if n_acc[r] >= 1]
    for i, tokens in ((0, first), (1, second)):
        p = sampler.probs(exact[:1, i], hist[:1])[0].double()
        counts = torch.bincount(torch.tensor(tokens), minlength=v).double()
        assert chi_square_p(counts, p * len(tokens)) > 1e-3, i
        qi = q[0, i].double()
        assert chi_square_p(counts, qi * len(tokens)) < 1e-6  # the draft's distribution does not fit
    overlap = float(torch.minimum(sampler.probs(exact[:1, 0], hist[:1])[0], q[0, 0]).sum())
    assert 0.05 < overlap < 0.95
    assert abs(sum(1 for n in n_acc if n) / b - overlap) < 0.03


def test_sampling_seed_reproduces(tiny_model, reference):
    ps, _ = reference
    config = CacheConfig(mode="exact", chunk_size=64, **TINY)
    gen = GenerationConfig(max_tokens=NEW, temperature=0.9, top_p=0.9, seed=7)
    a, b = run(tiny_model, ps, config, gen), run(tiny_model, ps, config, gen)
    c = run(tiny_model, ps, config, GenerationConfig(**{**gen.__dict__, "seed": 8}))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert all(len(t) == NEW for t in a.tokens)


def test_exact_figures_of_several_calls_add_up():
    """A map-reduce job makes several model calls: its --json exact figures are over all of them."""
    def totals(drafted, accepted, rows, verifies, gamma_sum, draft_s, verify_s):
        return {"drafted": drafted, "accepted": accepted, "row_cycles": rows, "tokens": accepted + rows,
                "verifies": verifies, "gamma_sum": gamma_sum, "draft_s": draft_s, "draft_passes": gamma_sum,
                "verify_s": verify_s}

    a, b = totals(40, 30, 10, 10, 40, 0.8, 1.5), totals(12, 3, 6, 3, 6, 0.1, 0.2)
    both = {k: a[k] + b[k] for k in a}
    merged = steps.merge_exact_stats({"mode": "exact", **steps.exact_stats(a, None)},
                                     {"mode": "exact", "device_bytes": 7, **steps.exact_stats(b, None)})
    want = steps.exact_stats(both, None)
    assert merged["acceptance_rate"] == want["acceptance_rate"] == round(33 / 52, 4)
    assert merged["verifies"] == 13 and merged["drafted"] == 52 and merged["device_bytes"] == 7
    for key in ("tokens_per_verify", "gamma_mean", "draft_pass_ms", "verify_ms"):
        assert merged[key] == pytest.approx(want[key], abs=2e-3), key
    plain = {"mode": "full", "device_bytes": 3}
    assert steps.merge_exact_stats({}, plain) == plain and steps.merge_exact_stats(plain, {"mode": "full"}) == \
        {"mode": "full"}


def test_gamma_is_validated():
    for bad in (0, 17):
        with pytest.raises(BadArgument):
            CacheConfig(mode="exact", gamma=bad)


def test_gamma_chooser_follows_acceptance_and_costs():
    chooser = steps.GammaChooser()
    assert chooser.choose() == chooser.start
    for _ in range(30):  # all accepted, a draft much cheaper than a verify: long drafts
        chooser.record(accepted=8, rejected=0, gamma=8, draft_s=8 * 0.001, verify_s=0.05)
    assert chooser.choose() == 16
    for _ in range(60):  # nothing accepted: the shortest draft
        chooser.record(accepted=0, rejected=1, gamma=4, draft_s=4 * 0.01, verify_s=0.02)
    assert chooser.choose() == 1
    assert steps.GammaChooser(fixed=5).choose() == 5


FIDELITY_DOCS = ["report.pdf", "texts/federalist.txt", "texts/origin-of-species-introduction.txt"]


TIE = 1e-3  # logits within this of each other are a tie at float rounding (a wrong attention moves them by >> 0.01)


def forced_logits(lm, config: CacheConfig, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """The mode's next-token logits [len(forced), V] along `forced` (its real step loop, teacher forced)."""
    return torch.stack(list(Engine(lm.model, config).teacher_forced(prompt, forced)))


@pytest.mark.slow
@pytest.mark.parametrize("name", FIDELITY_DOCS)
def test_embedded_model_exact_equals_full_on_the_fidelity_documents(name):
    """Greedy exact == full over 256 tokens on each document bench fidelity uses (examples/),
    the prompt cut to 2048 tokens (the bench's whole window would take minutes per mode here).
    Token for token holds to float rounding: where a linear or torch's attention rounds a pass of
    several tokens unlike one of one (torch's GEMM with SPECACHE_NATIVE=0, SDPA over gamma + 1
    queries, the plain-C x86-64-v2 build's other drafts), the two may part, and only at a tie: full's
    logits there put the two choices within TIE, and exact's logits equal full's to TIE."""
    from engine.bench.common import EXAMPLES, load_texts
    from engine.bench.fidelity import fit_prompt
    from engine.model.loading import load_model
    from engine.plan.profiles import model_defaults

    lm = load_model(None, device="cpu")
    gen = GenerationConfig(max_tokens=256)
    ((source, text),) = load_texts([str(EXAMPLES / name)])
    prompt, _ = fit_prompt(lm.tokenizer, text, 2048)
    full_cfg, exact_cfg = CacheConfig(mode="full"), CacheConfig(mode="exact", **model_defaults(lm))
    full, exact = run(lm.model, [prompt], full_cfg, gen), run(lm.model, [prompt], exact_cfg, gen)
    assert len(full.tokens[0]) == 256, source
    assert exact.cache_stats["acceptance_rate"] > 0.5, source
    a, b = full.tokens[0], exact.tokens[0]
    if a != b:
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        want = forced_logits(lm, full_cfg, prompt, a[: i + 1])[i]  # [V] what preceded the parting token
        got = forced_logits(lm, exact_cfg, prompt, a[: i + 1])[i]
        margin = float(want[a[i]] - want[b[i]])
        print(source, f"parts at token {i}: full's margin {margin:.2e}, max |exact - full| "
                      f"{float((got - want).abs().max()):.2e}")
        assert 0 <= margin < TIE, (source, i, margin)
        assert torch.allclose(got, want, atol=TIE, rtol=0), (source, i)
    print(source, len(prompt), len(a), exact.cache_stats)


def test_planner_exact_row():
    """The exact row: geometric expected tokens, the verification on a PCIe GPU streams every exact
    K/V (B * N * kv bytes) and is bound by that copy at 32k; on a CPU nothing is copied."""
    from engine.kvcache import sizes as S
    from engine.plan import planner as P
    from engine.plan import roofline as R
    from engine.plan.profiles import load_hardware, load_model_profile

    assert R.expected_tokens(0.0, 8) == 1.0 and R.expected_tokens(1.0, 8) == 9.0
    assert abs(R.expected_tokens(0.5, 2) - 1.75) < 1e-12
    m = load_model_profile("mistral-7b")
    gpu = P.plan(load_hardware("rtx-a6000"), m, 32768).mode("exact")
    kv = S.kv_bytes_per_token(m, 2)
    assert gpu.transfer_bytes_per_step == gpu.max_batch * 32768 * kv
    assert gpu.device_breakdown["verify_buffers"] == 2 * 32768 * kv // m.layers
    assert gpu.verify_seconds == pytest.approx(gpu.transfer_bytes_per_step / (load_hardware("rtx-a6000").h2d_gbps * 1e9))
    assert 1 <= gpu.gamma <= 16 and gpu.acceptance == R.EXACT_ACCEPTANCE
    per_token = (gpu.gamma * gpu.draft_seconds + gpu.verify_seconds) / R.expected_tokens(gpu.acceptance, gpu.gamma)
    assert gpu.tokens_per_second == pytest.approx(gpu.max_batch / per_token)
    cpu = P.plan(load_hardware("cpu"), load_model_profile("smollm2-135m"), 6500).mode("exact")
    assert cpu.transfer_bytes_per_step == 0 and "verify_buffers" not in cpu.device_breakdown


def test_cli_exact_equals_full_and_reports_its_figures(tiny_model_dir):
    """`ask --cache exact` (and --gamma) through the CLI: full's text, the exact figures in the JSON,
    a bad --gamma a one-line error with the bad-argument exit code."""
    import json
    import re
    from pathlib import Path

    from typer.testing import CliRunner

    from specache_cli.app import app

    doc = str(Path(__file__).parent / "data" / "sample.txt")
    runner = CliRunner()

    def ask(*extra):
        return runner.invoke(app, ["ask", "--model", str(tiny_model_dir), "--quiet", "--no-store", "--doc", doc,
                                   "What is this about?", "--max-tokens", "12", "--json", "--group", "32", *extra])

    full, exact, fixed = ask("--cache", "full"), ask("--cache", "exact"), ask("--cache", "exact", "--gamma", "3")
    assert full.exit_code == exact.exit_code == fixed.exit_code == 0, exact.stderr
    f, e, g = (json.loads(r.stdout) for r in (full, exact, fixed))
    assert e["text"] == f["text"] == g["text"]
    assert e["cache"]["mode"] == "exact" and e["cache"]["gamma"] == "auto" and g["cache"]["gamma"] == 3
    assert {"acceptance_rate", "tokens_per_verify", "gamma_mean", "verify_ms", "draft_pass_ms"} <= set(e["cache"])
    loud = runner.invoke(app, ["ask", "--model", str(tiny_model_dir), "--no-store", "--doc", doc, "What is it?",
                               "--max-tokens", "12", "--group", "32", "--cache", "exact"])
    assert loud.exit_code == 0 and re.search(r"cache exact: .*drafts accepted \d+%, [\d.]+ tokens per verification",
                                             loud.stderr), loud.stderr
    bad = ask("--cache", "exact", "--gamma", "0")
    assert bad.exit_code == BadArgument.exit_code and bad.stderr.strip().startswith("error:") and "--gamma" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_bench_decode_and_fidelity_take_exact(tiny_model_dir, tmp_path):
    """`bench decode` times exact per token of a row (a step is a cycle) with its figures and
    target; `bench fidelity` runs exact and finds it identical to full."""
    import json

    from typer.testing import CliRunner

    from specache_cli.app import app

    def bench(name, *args):
        r = CliRunner().invoke(app, ["bench", name, "--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path),
                                     "--threads", "1", "--json", *args], catch_exceptions=False)
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout), (tmp_path / f"{name}.md").read_text()

    result, md = bench("decode", "--modes", "full,exact-gamma3", "--batches", "1,2", "--length", "200")
    rows = {(x["mode"], x["batch"]): x for x in result["rows"]}
    for batch in (1, 2):
        x = rows[("exact-gamma3", batch)]
        assert x["exact"]["gamma"] == 3 and 0 <= x["exact"]["acceptance_rate"] <= 1
        assert 1 <= x["exact"]["tokens_per_verify"] <= 4
        assert x["speedup_vs_full"] == pytest.approx(rows[("full", batch)]["ms_per_step"] / x["ms_per_step"], rel=1e-2)
    assert [t["goal"] for t in result["targets"]] == [">= 1.3x"] * 2
    assert "tokens/verify" in md
    result, _ = bench("fidelity", "--modes", "full,exact", "--tokens", "8")
    exact_rows = [r for r in result["rows"] if r["mode"] == "exact"]
    assert exact_rows and all(r["teacher_forced"]["top1_agreement"] == 1.0 for r in exact_rows)
    assert all(r["free_running"]["equal_share"] == 1.0 for r in exact_rows)


def test_gamma_chooser_ignores_an_untimed_first_cycle():
    """A slow first cycle (one-time costs) must not fix the verify-time slope for good."""
    chooser = steps.GammaChooser()
    chooser.record(accepted=4, rejected=0, gamma=4, draft_s=None, verify_s=None)
    assert chooser.draft_s is None and chooser.choose() == chooser.start and chooser.acceptance > 0.7
    for _ in range(20):
        chooser.record(accepted=4, rejected=0, gamma=4, draft_s=4 * 0.05, verify_s=0.17)
    assert chooser.choose() > 4  # flat verify cost, cheap drafts, everything accepted: draft longer


def test_gamma_chooser_verify_cost_is_never_extrapolated_below_what_was_seen():
    """Verify times 0.15 s at 2 tokens, 0.2 at 5, 1.5 at 17 (convex): 3 tokens interpolate, 1 token
    costs what 2 did, 20 tokens continue the 5 -> 17 slope; so gamma neither collapses to 1 on a
    negative extrapolation nor runs to 16."""
    chooser = steps.GammaChooser()
    for gamma, verify in ((1, 0.15), (4, 0.2), (16, 1.5)):
        chooser.record(accepted=gamma, rejected=0, gamma=gamma, draft_s=gamma * 0.06, verify_s=verify)
    assert chooser.verify_seconds(2) == pytest.approx(0.15)
    assert chooser.verify_seconds(1) == chooser.verify_seconds(2)
    assert 0.15 < chooser.verify_seconds(3) < 0.2
    assert chooser.verify_seconds(20) == pytest.approx(1.5 + 3 * (1.5 - 0.2) / 12)
    assert 2 < chooser.choose() < 16
