"""A cache setting is one declaration (engine.config.Setting on a CacheConfig field): a setting added
there is a flag of summarize, ask and plan, a setting in the plan's output, a bench label option,
a checked bound and a part of the document store's key, with nothing else edited.

The new setting is added in a child process, before the CLI is imported (the CLI's options are
built when its modules are imported), as a subclass of CacheConfig that replaces it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent('''
    import dataclasses
    import json

    import engine.config as C

    @dataclasses.dataclass(frozen=True)
    class CacheConfig(C.CacheConfig):
        probe_width: int | None = C.setting(None, "A test's setting", default_rule="unset", low=1, high=64,
                                            label="pw{}", plan=9, store=True)

    C.CacheConfig = CacheConfig  # before anything else imports it

    import torch
    from typer.testing import CliRunner

    from engine.bench.common import parse_mode
    from engine.errors import BadArgument
    from engine.generate.prefixes import store_settings
    from engine.kvcache import make_cache
    from specache_cli.app import app
    from tests.conftest import tiny_config

    runner = CliRunner()
    out = {"help": {cmd: runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"}).stdout
                    for cmd in ("summarize", "ask", "plan")}}
    plan = runner.invoke(app, ["plan", "--gpu", "l4", "--model", "smollm2-135m", "--context", "4096",
                               "--probe-width", "7", "--json"])
    out["plan"] = json.loads(plan.stdout)["settings"] if plan.exit_code == 0 else plan.stderr
    bad = runner.invoke(app, ["plan", "--gpu", "l4", "--probe-width", "65"])
    out["plan_bad"] = [bad.exit_code, bad.stderr]
    out["label"] = parse_mode("specache-1b-pw5").config.probe_width
    try:
        parse_mode("specache-pw0")
    except BadArgument as exc:
        out["label_bad"] = str(exc)
    keys = []
    for width in (None, 3):
        config = CacheConfig(mode="specache", k=16, group=32, residual=16, probe_width=width)
        with make_cache(tiny_config(), config, 1, 256, torch.float32, torch.device("cpu")) as cache:
            keys.append(store_settings(cache, torch.float32, "tiny"))
    out["store"] = keys
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def added():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", ["summarize", "ask", "plan"])
def test_a_new_setting_is_a_flag_of_each_command(added, command):
    assert "--probe-width" in added["help"][command] and "A test's setting (default: unset)." in added["help"][command]


def test_a_new_setting_is_in_the_plan_and_checked(added):
    settings = added["plan"]
    assert isinstance(settings, dict), settings
    assert settings["probe_width"] == 7
    assert list(settings)[-1] == "probe_width"  # its place (Setting.plan 9): after the outliers
    code, err = added["plan_bad"]
    assert code == 2 and "--probe-width must be in 1..64, not 65" in err


def test_a_new_setting_is_a_bench_label_option(added):
    assert added["label"] == 5
    assert added["label_bad"] == "--probe-width must be in 1..64, not 0"


def test_a_new_setting_is_in_the_store_key_when_set(added):
    default, set_ = added["store"]
    assert "probe_width" not in default  # at its default the key is the one it had before the setting
    assert set_["probe_width"] == 3 and {k: v for k, v in set_.items() if k != "probe_width"} == default


def test_the_shipped_settings_keep_their_flags_and_label_options():
    """The declarations give the flags and label options the docs name."""
    from engine.bench.common import option_name
    from engine.config import settings

    declared = settings()
    assert [declared[n].flag for n in ("k", "chunk_size", "measure_hits")] == ["--k", "--chunk-size", "--hit-rate"]
    assert [option_name(n) for n in ("bits", "k", "group", "gamma", "window")] == ["<n>b", "k<n>", "g<n>", "gamma<n>",
                                                                                  "w<n>"]
    assert {n for n, d in declared.items() if d.plan is not None} == {"bits", "group", "k", "residual", "sinks",
                                                                      "chunk_size", "outliers"}


def test_help_texts_match_what_the_flags_take():
    """--model's help names every source it takes; plan's help names every column it prints."""
    from typer.testing import CliRunner

    from engine.plan.planner import plan_columns
    from specache_cli.app import app

    runner = CliRunner()
    for command in (["summarize"], ["ask"], ["bench", "fidelity"]):
        text = " ".join(runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400"}).stdout.split())
        for source in ("local Hugging Face folder", "GGUF file", "Hugging Face id in the local cache",
                       "ollama:NAME[:TAG]"):
            assert source in text, (command, source)
    text = " ".join(runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "400"}).stdout.split())
    assert all(column in text for column in plan_columns()), text
