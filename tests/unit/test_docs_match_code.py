"""The docs name what exists: every ``loraplane ...`` command line quoted in a doc or in a
``--help`` text names a subcommand and options the CLI has, every ``python -m MODULE --opt``
an option of that module, and every repository path or relative link a file or folder of the
repository. Docs are every tracked ``*.md`` but CHANGELOG.md (history) and test data; a
command line is a fenced code block's line (``\\`` continuations joined) or an inline code
span."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from loraplane import cli
from tests.repository_files import repository_files

ROOT = Path(__file__).resolve().parents[2]
ROOT_COMMAND: Any = typer.main.get_command(cli.app)

COMMAND = re.compile(r"(?:(?<![\w/.\-])|(?<=bin/))loraplane (?=[a-z\-\[])")
SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
OPTION = re.compile(r"^[\[(]?(--?[A-Za-z][\w\-]*)")
SHELL_END = {"|", "&&", "||", ";", ">", ">>", "2>", "2>&1", "&", ")"}
REPO_FOLDERS = (
    ".ci/",
    "bench/",
    "dashboards/",
    "docs/",
    "examples/",
    "infra/",
    "loraplane/",
    "schemas/",
    "scripts/",
    "streams/",
    "tests/",
    "workers/",
)
PATH = re.compile(r"(?:\./)?[\w.\-]+(?:/[\w.\-]+)*/?")


TRACKED = repository_files()
TRACKED_SET = set(TRACKED)
FOLDERS = {str(parent) for p in TRACKED for parent in Path(p).parents if str(parent) != "."}
DOCS = sorted(
    p
    for p in TRACKED
    if p.endswith(".md") and p != "CHANGELOG.md" and not p.startswith("tests/data/")
)


def snippets(text: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every fenced code line (continuations joined) and inline span."""
    prose: list[str] = []
    lines = text.splitlines()
    fenced = False
    n = 0
    while n < len(lines):
        line = lines[n]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced:
            first = n
            while line.rstrip().endswith("\\") and n + 1 < len(lines):
                n += 1
                line = line.rstrip()[:-1] + " " + lines[n]
                prose.append("")
            yield first + 1, line
            prose.append("")
        else:
            prose.append(line)
        n += 1
    joined = "\n".join(prose)
    for match in SPAN.finditer(joined):
        yield joined.count("\n", 0, match.start()) + 1, " ".join(match[2].split())


def command_lines(text: str) -> Iterator[str]:
    """What follows each ``loraplane `` that starts a command (not an option's value, a
    Helm release name or a path)."""
    for match in COMMAND.finditer(text):
        before = text[: match.start()].split()
        if before and (before[-1].startswith("-") or before[-1] in {"install", "upgrade"}):
            continue
        words = text[match.end() :].split()
        if words and (words[0].count("/") > 1 or ("/" in words[0] and "." in words[0])):
            continue
        yield text[match.end() :]


def problems(line: str) -> list[str]:
    """Why ``loraplane LINE`` is not a command line of the CLI; ``[]`` when it is. A word
    ``a/b`` stands for both subcommands; option tokens may be bracketed (``[--json]``)."""
    words = line.replace("\\|", " ").split()
    command, path = ROOT_COMMAND, ["loraplane"]
    n = 0
    while hasattr(command, "commands") and n < len(words):
        word = words[n].strip("[](),.:;`'\"")
        if word in {"--help", "-h"}:
            return []
        names = word.split("/")
        if not all(name in command.commands for name in names):
            return [f"{' '.join(path)} has no subcommand {word!r}"]
        command = command.commands[names[0]]
        path.append(word)
        n += 1
    if hasattr(command, "commands"):
        return []  # a group named on its own
    options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    found = []
    for word in words[n:]:
        if word in SHELL_END or word.startswith("#"):
            break
        option = OPTION.match(word)
        if option and option[1] not in options:
            found.append(f"{' '.join(path)} has no option {option[1]}")
        if re.search(r"[`)]", word) and not re.fullmatch(r"[\[(]?--?[\w\-]+[`)\],.;:]*", word):
            break  # the span or the parenthesis that holds the command ends here
    return found


def help_texts() -> Iterator[tuple[str, str]]:
    def walk(command: Any, path: list[str]) -> Iterator[tuple[str, str]]:
        yield " ".join(path), command.help or ""
        for param in command.params:
            yield f"{' '.join(path)} {'/'.join(param.opts)}", getattr(param, "help", None) or ""
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    yield from walk(ROOT_COMMAND, ["loraplane"])


def quoted_commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for line, snippet in snippets((ROOT / doc).read_text(encoding="utf-8")):
            out += [(f"{doc}:{line}", c) for c in command_lines(snippet)]
    for where, text in help_texts():
        for span in SPAN.finditer(" ".join(text.split())):
            out += [(f"--help of {where}", c) for c in command_lines(span[2])]
    return out


QUOTED = quoted_commands()


def test_the_scan_sees_the_quoted_commands() -> None:
    assert len(QUOTED) > 250
    seen = {where.split(":")[0] for where, _ in QUOTED}
    assert {"README.md", "docs/worker.md", "dashboards/README.md"} <= seen
    assert any(where.startswith("--help of") for where, _ in QUOTED)
    assert any(c.startswith("worker run --command-slot") for _, c in QUOTED)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("worker run --bogus 3", ["loraplane worker run has no option --bogus"]),
        ("worker run [--nope]", ["loraplane worker run has no option --nope"]),
        ("registry list/shows", ["loraplane registry has no subcommand 'list/shows'"]),
        ("stack upp", ["loraplane stack has no subcommand 'upp'"]),
        ("publish … [--json] [--wait-s S] --doc", ["loraplane publish has no option --doc"]),
        ("registry list/show", []),
        ("stack logs -f kafka | tail --bogus", []),
        ("report --since 1h`, and more --bogus", []),
        ("simulate --workers N \\| --add-workers N", []),
        ("keys generate --help", []),
    ],
)
def test_a_command_line_is_checked_against_the_cli(line: str, expected: list[str]) -> None:
    assert problems(line) == expected


def test_not_a_command_is_not_checked() -> None:
    text = (
        "helm upgrade --install loraplane infra/helm/loraplane -n loraplane; "
        "simulate --policy loraplane --policy lru; loraplane worker run --x"
    )
    assert list(command_lines(text)) == ["worker run --x"]


def test_every_quoted_command_line_exists_in_the_cli() -> None:
    found = [f"{where}: {p}" for where, line in QUOTED for p in problems(line)]
    assert found == [], "a doc or --help names what the CLI lacks:\n" + "\n".join(found)


PYTHON_M = re.compile(r"python -m ((?:bench|loraplane|scripts|tests)(?:\.\w+)+)([^`|#\n]*)")


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    tries = [Path(*parts).with_suffix(".py"), Path(*parts) / "__main__.py"]
    if parts[0] == "loraplane":  # the repository's folders are subpackages of loraplane
        tries += [Path(*parts[1:]).with_suffix(".py"), Path(*parts[1:]) / "__main__.py"]
    return next((ROOT / t for t in tries if (ROOT / t).is_file()), None)


def test_every_python_m_command_names_a_module_and_its_options() -> None:
    found, seen = [], 0
    for doc in DOCS:
        for line, snippet in snippets((ROOT / doc).read_text(encoding="utf-8")):
            for match in PYTHON_M.finditer(snippet):
                seen += 1
                source = _module_file(match[1])
                if source is None:
                    found.append(f"{doc}:{line}: no module {match[1]}")
                    continue
                text = source.read_text(encoding="utf-8")
                for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", match[2]):
                    if f'"{option}"' not in text and f"'{option}'" not in text:
                        found.append(f"{doc}:{line}: {match[1]} has no option {option}")
    assert seen > 20
    assert found == [], "\n".join(found)


def _exists(path: str) -> bool:
    path = path.removeprefix("./").rstrip("/")
    return path in TRACKED_SET or path in FOLDERS


def test_every_repository_path_a_doc_names_exists() -> None:
    """An inline span that is a path under one of the repository's folders (no placeholder
    such as ``DIR`` or ``*``), and every relative link, names a tracked file or folder."""
    found, seen = [], 0
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for line, snippet in snippets(text):
            path = snippet.strip().rstrip(".,:;")
            if (
                PATH.fullmatch(path)
                and path.removeprefix("./").startswith(REPO_FOLDERS)
                and not re.search(r"[A-Z]{2,}", path)
            ):
                seen += 1
                if not _exists(path):
                    found.append(f"{doc}:{line}: {path}")
        for number, row in enumerate(text.splitlines(), 1):
            for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", row):
                if "://" in link or link.startswith("mailto:"):
                    continue
                seen += 1
                target = (ROOT / doc).parent / link
                if not target.exists():
                    found.append(f"{doc}:{number}: link {link}")
    assert seen > 300
    assert found == [], "docs name paths the repository lacks:\n" + "\n".join(found)
