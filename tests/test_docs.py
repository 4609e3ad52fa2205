"""The docs against the code: README.md and docs/*.md name only flags the CLI (or the script they name) has, state
the code's defaults, link only to files (and headings) that exist, and the README stays short. No model is loaded.

Conventions the checks read:
- A flag in a code span or a code-block line that runs `specache CMD` must be an option of CMD; one in a span or
  line that names `scripts/NAME` must appear in that script; one under an external tool (pip, ray, ...) is that
  tool's (EXTERNAL); any other flag, prose included, must be an option of some specache command.
- A flag table is a Markdown table whose header starts `| flag of `CMD`[, `CMD`...] | default |`. Each row names
  one or more flags; its default cell is either checkable (comma-separated values, each a backticked literal, a
  number, `on` or `off`, one per option named) and then must equal the code's default for every command of the
  header, or words ("the model profile's") and then the code's default must be unset (None: decided at run time).
  A cache setting's default is its declared rule (engine.config.Setting.default_rule), else its field default.
"""
from __future__ import annotations

import dataclasses
import glob
import re
from pathlib import Path

import click
import pytest
import typer.main

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 400
# flags of other programs, named beside them in the docs: tool -> its flags the docs use
EXTERNAL = {
    "pip install": {"--no-deps"},
    "installed with": {"--no-deps"},
    "ray start": {"--head", "--port", "--address"},
    "pytest": {"--co", "--collect-only"},
}
FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
LONG_FLAG = re.compile(r"(?<![\w/.-])--[a-z][a-z0-9-]*")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
SCRIPT = re.compile(r"scripts/[\w.-]+")
COMMAND = re.compile(r"(?:^|[\s(|;/])specache(?:\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?)?(?![\w/.-])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./:$~-])((?:docs|engine|specache_cli|scripts|tests|profiles|examples|bench-results|\.ci)"
                  r"/[\w./*<>-]*[\w*])")
CHECKABLE = re.compile(r"`[^`]+`|-?\d+(?:\.\d+)?|on|off")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands() -> dict[str, click.Command]:
    """Every specache command by its path ('' the root, 'summarize', 'bench decode', 'cache ls', ...)."""
    from specache_cli.app import app

    out: dict[str, click.Command] = {}

    def walk(command: click.Command, path: str) -> None:
        out[path] = command
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(typer.main.get_command(app), "")
    return out


def option_names(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(n for n in (*param.opts, *getattr(param, "secondary_opts", ())) if n.startswith("-"))
    return names


def blocks(text: str):
    """(first line number, [lines], is a code block): each fenced block, each table row, each paragraph."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```")), len(lines))
            yield i + 2, lines[i + 1:end], True
            i = end + 1
        elif not line.strip():
            i += 1
        elif line.startswith("|"):
            yield i + 1, [line], False
            i += 1
        else:
            end = i
            while end < len(lines) and lines[end].strip() and not lines[end].startswith("|") \
                    and not lines[end].lstrip().startswith("```"):
                end += 1
            indented = all(row.startswith("    ") for row in lines[i:end])  # an indented code block
            yield i + 1, lines[i:end], indented
            i = end


def pieces(lines: list[str], code: bool):
    """(line offset, text, is code) in order: a code block's lines; a paragraph's code spans and prose."""
    if code:
        yield from ((n, line, True) for n, line in enumerate(lines))
        return
    text = "\n".join(lines)
    at = 0
    for match in SPAN.finditer(text):
        yield text.count("\n", 0, at), text[at:match.start()], False
        yield text.count("\n", 0, match.start()), match.group(2), True
        at = match.end()
    yield text.count("\n", 0, at), text[at:], False


def owner_of(snippet: str, every: dict[str, set[str]]):
    """What a code snippet runs: ('command', name), ('file', repo path), ('tool', name) or None."""
    for tool in EXTERNAL:
        if tool in snippet:
            return "tool", tool
    command = COMMAND.search(snippet)
    if command:
        first, second = command.groups()
        name = f"{first} {second}" if f"{first} {second}" in every else first or ""
        if name in every:
            return "command", name
    for word in re.findall(r"[\w./-]+", snippet):
        if "/" in word:
            candidates = [word] if re.match(r"(scripts|tests)/", word) else []
        elif re.search(r"\.(py|sh|mjs)$", word):
            candidates = [f"scripts/{word}"]
        else:
            candidates = [f"scripts/{word}.py"]  # a script named without its folder and extension (gpu_check)
        for candidate in candidates:
            if (ROOT / candidate).is_file():
                return "file", candidate
    return None


def allowed(flag: str, owner, every: dict[str, set[str]]) -> bool:
    kind, name = owner
    if kind == "tool":
        return flag in EXTERNAL[name]
    if kind == "command":
        return flag in every[name]
    return flag in (ROOT / name).read_text()


def flag_problems(path: Path, every: dict[str, set[str]]) -> list[str]:
    """A flag in a snippet that names what it runs belongs to that; one in a later snippet of the same block
    belongs to the last thing named (or to any specache command); any other to some specache command."""
    known = set().union(*every.values())
    problems = []
    for first, lines, code in blocks(path.read_text()):
        carried = None
        for offset, snippet, is_code in pieces(lines, code):
            named = owner_of(snippet, every) if is_code else next(
                (("tool", tool) for tool in EXTERNAL if tool in snippet), None)
            carried = named or carried
            for flag in LONG_FLAG.findall(snippet):
                where = f"{path.relative_to(ROOT)}:{first + offset}"
                if named:
                    if not allowed(flag, named, every):
                        problems.append(f"{where}: {flag} is not a flag of {named[1]}")
                elif is_code and carried and allowed(flag, carried, every) or flag in known:
                    continue
                else:
                    problems.append(f"{where}: {flag} is not an option of any specache command")
    return problems


def test_every_flag_the_docs_name_exists():
    every = {name: option_names(command) for name, command in commands().items()}
    problems = [p for path in doc_files() for p in flag_problems(path, every)]
    assert not problems, "\n".join(problems)


# --- defaults ------------------------------------------------------------------------------------

def flag_tables(text: str):
    """(line number, [command paths], [(flag names, default cell)]) per flag table."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("flag of ") or cells[1] != "default":
            continue
        names = [n.strip() for n in re.findall(r"`([^`]+)`", cells[0])]
        rows = []
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            row_cells = [c.strip() for c in row.strip().strip("|").split("|")]
            rows.append((i + 3 + len(rows), FLAG.findall(row_cells[0]), row_cells[1]))
        yield names, rows


def code_default(param: click.Parameter):
    """What the code takes when the flag is not given: click's default, or for a cache setting (unset on the
    command line: None) its declared rule, else its field default."""
    if param.default is not None:
        return param.default
    from engine.config import CacheConfig, settings

    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    for name, declared in settings().items():
        if declared.flag in param.opts:
            return declared.default_rule or fields[name].default
    return None


def same(stated: str, actual) -> bool:
    if stated in ("on", "off"):
        return actual is (stated == "on") or str(actual).lower() == ("true" if stated == "on" else "false")
    stated = stated.strip("`")
    try:
        return float(stated) == float(actual)
    except (TypeError, ValueError):
        return stated == str(actual)


def default_problems(path: Path, every: dict[str, click.Command]) -> list[str]:
    problems = []
    for names, rows in flag_tables(path.read_text()):
        for name in names:
            if name not in every:
                problems.append(f"{path.relative_to(ROOT)}: flag table of unknown command `{name}`")
        for number, flags, cell in rows:
            where = f"{path.relative_to(ROOT)}:{number}"
            parts = [p.strip() for p in cell.split(",")]
            checkable = all(CHECKABLE.fullmatch(p) for p in parts)
            for name in (n for n in names if n in every):
                params: list[click.Parameter] = []
                for flag in flags:
                    param = next((p for p in every[name].params
                                  if flag in (*p.opts, *getattr(p, "secondary_opts", ()))), None)
                    if param is None:
                        problems.append(f"{where}: {flag} is not an option of `specache {name}`")
                    elif param not in params:
                        params.append(param)
                if checkable and len(parts) != len(params):
                    problems.append(f"{where}: {len(parts)} defaults for {len(params)} options")
                    continue
                for i, param in enumerate(params):
                    actual = code_default(param)
                    if checkable and not same(parts[i], actual):
                        problems.append(f"{where}: `specache {name}` {param.opts[0]} defaults to {actual!r}, "
                                        f"the docs say {parts[i]}")
                    if not checkable and param.default is not None:
                        problems.append(f"{where}: `specache {name}` {param.opts[0]} defaults to "
                                        f"{param.default!r}; state it as a value, not in words ({cell!r})")
    return problems


def test_the_flag_tables_state_the_code_defaults():
    every = commands()
    problems = [p for path in doc_files() for p in default_problems(path, every)]
    assert not problems, "\n".join(problems)


def test_the_readme_has_flag_tables_to_check():
    tables = list(flag_tables((ROOT / "README.md").read_text()))
    assert {"summarize", "ask", "plan"} <= {name for names, _ in tables for name in names}
    assert sum(len(rows) for _, rows in tables) >= 20


# --- paths and links -----------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def exists(relative: str) -> bool:
    relative = re.sub(r"\b[A-Z][A-Z_]*[A-Z]\b", "*", relative)  # a placeholder: profiles/hardware/NAME.yaml
    if any(c in relative for c in "*<>"):
        return bool(glob.glob(str(ROOT / re.sub(r"<[^>]*>", "*", relative))))
    return (ROOT / relative).exists()


def path_problems(path: Path) -> list[str]:
    problems = []
    text = path.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{number}"
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                problems.append(f"{where}: link to missing {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
        for relative in PATH.findall(line):
            if re.search(r"\b(removed|git show)\b", line) and relative.startswith("scripts/"):
                continue  # a script the line says is gone, with the commit that still has it
            if not exists(relative.rstrip(".")):
                problems.append(f"{where}: {relative} does not exist")
    return problems


def test_every_path_and_link_in_the_docs_exists():
    problems = [p for path in doc_files() for p in path_problems(path)]
    assert not problems, "\n".join(problems)


def test_the_docs_stand_alone():
    """Nothing outside the repository: no absolute paths of this machine, no sibling folders."""
    problems = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for path in doc_files()
                for n, line in enumerate(path.read_text().splitlines(), 1)
                if re.search(r"\.\./shared|(?<![\w.])/work/|/home/\w", line)]
    assert not problems, "\n".join(problems)


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("stated, actual, ok", [("`auto`", "auto", True), ("512", "512", True), ("1.0", 1, True),
                                               ("on", True, True), ("off", True, False), ("`a`", "b", False)])
def test_same(stated, actual, ok):
    assert same(stated, actual) is ok
