"""The command line a systemd unit of ``infra/systemd/`` runs, worked out as systemd would:
its ``EnvironmentFile``s and ``Environment``s, the specifiers ``%i``, ``%I``, ``%H`` and
``%%``, ``${VAR}`` (one word) and ``$VAR`` (split on white space), then the words.
``parse_cli`` parses a ``loraplane ...`` command line with the CLI's own parser without
running it. So the units are checked against the CLI they start (tests/unit), and can be
tried by hand without systemd (docs/deploy.md, "Trying a unit here"):

    python -m loraplane.infra.systemd_units infra/systemd/loraplane-router.service \\
        --env-file my.env [--instance 0] [--root /opt/loraplane=$PWD]

prints the command (shell-quoted) for ``eval`` or ``bash -c``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "INSTALL_ROOT",
    "Unit",
    "UnitError",
    "command_words",
    "environment_file",
    "main",
    "parse_cli",
    "specifiers",
]

INSTALL_ROOT = "/opt/loraplane"
"""Where the units expect the checkout, its ``.venv`` and ``.venv-vllm``."""
_EXEC_PREFIXES = "-@:+!"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class UnitError(ValueError):
    """A unit that systemd would not run as written (or that names a variable nobody sets)."""


@dataclass(frozen=True)
class Unit:
    path: Path
    service: dict[str, list[str]]  # key -> every value of the [Service] section, in order

    @classmethod
    def read(cls, path: Path) -> Unit:
        service: dict[str, list[str]] = {}
        section = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise UnitError(f"{path}: not KEY=VALUE: {line!r}")
            if section == "Service":
                service.setdefault(key.strip(), []).append(value.strip())
        return cls(path, service)

    @property
    def template(self) -> bool:
        return self.path.stem.endswith("@")

    def environment_files(self, instance: str = "") -> list[str]:
        """The ``EnvironmentFile`` paths, specifiers expanded (a leading ``-``: optional)."""
        return [specifiers(v, instance) for v in self.service.get("EnvironmentFile", [])]

    def environment(self, instance: str = "", host: str | None = None) -> dict[str, str]:
        """What the unit's ``Environment`` lines set; its EnvironmentFiles override them, as
        systemd reads them (``exec_start``)."""
        env: dict[str, str] = {}
        for value in self.service.get("Environment", []):
            for word in shlex.split(specifiers(value, instance, host)):
                key, _, val = word.partition("=")
                env[key] = val
        return env

    def exec_start(
        self, env_files: Mapping[str, Path], instance: str = "", host: str | None = None
    ) -> list[str]:
        """The words of ``ExecStart``; ``env_files`` maps each ``EnvironmentFile`` path of
        the unit to the file read in its place (every one must be given)."""
        if self.template and not instance:
            raise UnitError(f"{self.path.name} is a template: name an instance")
        starts = self.service.get("ExecStart", [])
        if len(starts) != 1:
            raise UnitError(f"{self.path.name}: {len(starts)} ExecStart lines, want 1")
        env = self.environment(instance, host)  # EnvironmentFile= wins over Environment=
        for name in self.environment_files(instance):
            source = env_files.get(name.lstrip("-"))
            if source is None:
                if name.startswith("-"):
                    continue
                raise UnitError(f"{self.path.name}: no file given for EnvironmentFile {name}")
            env |= environment_file(source)
        return command_words(specifiers(starts[0].lstrip(_EXEC_PREFIXES), instance, host), env)


def specifiers(text: str, instance: str, host: str | None = None) -> str:
    """``%i``/``%I`` (the instance), ``%H`` (the host name), ``%%``; any other is refused."""

    def one(match: re.Match[str]) -> str:
        spec = match.group(1)
        if spec == "%":
            return "%"
        if spec in "iI":
            return instance
        if spec == "H":
            return host or socket.gethostname()
        raise UnitError(f"specifier %{spec} is not supported here")

    return re.sub(r"%(.)", one, text)


def environment_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#``/``;`` comments, optional quotes), as systemd reads them."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise UnitError(f"{path}: not KEY=VALUE: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def command_words(line: str, env: Mapping[str, str]) -> list[str]:
    """systemd's split of an ``Exec`` line: quotes group words; ``${VAR}`` stays inside its
    word, a word that is exactly ``$VAR`` becomes that value's words. An unset variable is
    an error here (systemd would pass an empty string, which no loraplane option wants)."""

    def value(name: str) -> str:
        if name not in env:
            raise UnitError(f"${{{name}}} is set by no EnvironmentFile or Environment")
        return env[name]

    words: list[str] = []
    for word in shlex.split(line):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            words += value(bare.group(1)).split()
            continue
        words.append(_VARIABLE.sub(lambda m: value(m.group(1) or m.group(2)), word))
    return words


def parse_cli(args: Sequence[str]) -> tuple[str, dict[str, object]]:
    """The ``loraplane`` subcommand ``args`` name (``"worker run"``) and its parsed options,
    by the CLI's own parser, without running anything; raises the parser's UsageError (a
    missing or unknown option, a bad value) like the command would."""
    import typer.main

    from loraplane.cli import app

    command = typer.main.get_command(app)
    ctx = command.make_context("loraplane", list(args))
    names: list[str] = []
    while hasattr(command, "resolve_command"):  # a group: its subcommand follows
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            raise UnitError("a command group without its command")
        name, sub, left = command.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        names.append(name)
        ctx = sub.make_context(name, left, parent=ctx)
        command = sub
    return " ".join(names), dict(ctx.params)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("unit", type=Path)
    ap.add_argument("--instance", default="")
    ap.add_argument(
        "--env-file",
        type=Path,
        action="append",
        default=[],
        help="read in place of the unit's EnvironmentFiles, in their order",
    )
    ap.add_argument(
        "--root",
        default="",
        help=f"OLD=NEW: run from NEW instead of OLD (e.g. {INSTALL_ROOT}=$PWD)",
    )
    ns = ap.parse_args(argv)
    unit = Unit.read(ns.unit)
    names = [n.lstrip("-") for n in unit.environment_files(ns.instance)]
    if len(ns.env_file) != len(names):
        ap.error(f"{ns.unit.name} reads {len(names)} EnvironmentFile(s): {', '.join(names)}")
    words = unit.exec_start(dict(zip(names, ns.env_file, strict=True)), ns.instance)
    if ns.root:
        old, _, new = ns.root.partition("=")
        words = [new + w[len(old) :] if w.startswith(old) else w for w in words]
    print(shlex.join(words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
