"""The CI publishing example (examples/ci/): the GitHub Actions workflow passes actionlint
(built from its Go module by scripts/setup.d/55-actionlint.sh) and sets only settings that
exist; the shell script it calls passes shellcheck, parses release tags, hands loraplane's
result and exit code through, and fills the step outputs. Here the script drives a stand-in
``loraplane``; tests/integration/test_ci_publish.py runs it against the local stack."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from loraplane.kernel.config import Settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ci"
SCRIPT = EXAMPLE / "publish-adapter.sh"
WORKFLOW = EXAMPLE / "github-actions" / "publish-adapter.yml"
SETUP = ROOT / "scripts" / "setup.d" / "55-actionlint.sh"


def actionlint() -> Path:
    """The binary the set-up built; a skip only when its build failed (saying why)."""
    version = re.search(r"^ACTIONLINT_VERSION=(\S+)$", SETUP.read_text(), re.M)
    assert version, f"{SETUP} names no ACTIONLINT_VERSION"
    home = Path(os.environ.get("LORAPLANE_HOME", ROOT / ".loraplane"))
    folder = home / "cache" / f"actionlint-{version[1]}"
    if (folder / "build-failed.log").is_file():
        pytest.skip(
            f"actionlint {version[1]} could not be built by {SETUP.name}: "
            + (folder / "build-failed.log").read_text()[-400:]
        )
    assert (folder / "actionlint").is_file(), f"no actionlint in {folder}: run {SETUP}"
    return folder / "actionlint"


def lint(workflow: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(actionlint()), "-no-color", str(workflow)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_workflow_passes_actionlint() -> None:
    done = lint(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_does_find_a_mistake_in_it(tmp_path: Path) -> None:
    """The check bites: an output of a step that does not exist is an error."""
    broken = tmp_path / "publish-adapter.yml"
    text = WORKFLOW.read_text()
    assert "steps.publish.outputs.lora_name" in text
    broken.write_text(
        text.replace("steps.publish.outputs.lora_name", "steps.pubilsh.outputs.lora_name")
    )
    done = lint(broken)
    assert done.returncode == 1 and "pubilsh" in done.stdout, done.stdout + done.stderr
    if shutil.which("shellcheck") is None:
        return  # actionlint checks `run:` blocks only with shellcheck on PATH
    quoted = 'rm -rf "$RUNNER_TEMP/loraplane-secrets"'
    assert quoted in text
    broken.write_text(text.replace(quoted, quoted.replace('"', "")))
    done = lint(broken)
    assert done.returncode == 1 and "SC2086" in done.stdout, done.stdout + done.stderr


def test_the_script_passes_shellcheck() -> None:
    found = shutil.which("shellcheck")
    if found is None:
        pytest.skip(f"shellcheck is not installed ({SETUP} installs it)")
    done = subprocess.run(
        [found, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout


def _workflow() -> dict[Any, Any]:
    loaded = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_the_workflow_runs_the_script_on_the_tags_it_parses() -> None:
    flow = _workflow()
    assert flow[True]["push"]["tags"] == ["adapter/*/v*"]  # YAML 1.1 reads `on` as true
    runs = [s.get("run", "") for s in flow["jobs"]["publish"]["steps"]]
    assert 'examples/ci/publish-adapter.sh "$GITHUB_REF_NAME"' in runs
    assert SCRIPT.stat().st_mode & stat.S_IXUSR
    assert subprocess.run(
        ["git", "ls-files", "-s", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.startswith("100755"), "the script is committed executable"


def _env_names() -> set[str]:
    flow = _workflow()
    job = flow["jobs"]["publish"]
    names = set(job.get("env", {}))
    for step in job["steps"]:
        names |= set(step.get("env", {}))
        names |= set(re.findall(r'echo "([A-Z0-9_]+)=', step.get("run", "")))  # $GITHUB_ENV
    return names


def test_every_loraplane_setting_the_workflow_sets_exists() -> None:
    """LORAPLANE_X__Y is settings field x.y; a misspelt one would be silently ignored."""
    names = {n for n in _env_names() if n.startswith("LORAPLANE_")}
    assert {
        "LORAPLANE_KAFKA__USERNAME",
        "LORAPLANE_KAFKA__PASSWORD_FILE",
        "LORAPLANE_S3__SECRET_ACCESS_KEY",
    } <= names
    for name in names:
        model: type[BaseModel] = Settings
        *sections, leaf = name.removeprefix("LORAPLANE_").lower().split("__")
        for section in sections:
            annotation = model.model_fields[section].annotation
            assert isinstance(annotation, type) and issubclass(annotation, BaseModel), name
            model = annotation
        assert leaf in model.model_fields, f"{name}: no setting {leaf} in {model.__name__}"


def test_the_workflow_gives_the_script_everything_it_requires() -> None:
    required = re.search(r"^for name in (.+); do$", SCRIPT.read_text(), re.M)
    assert required
    assert set(required[1].split()) <= _env_names()


# ---- the script against a stand-in loraplane ------------------------------------------------

STAND_IN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STAND_IN_ARGS"], "w") as f:
    json.dump(sys.argv[1:], f)
sys.stdout.write(os.environ.get("STAND_IN_STDOUT", ""))
sys.exit(int(os.environ.get("STAND_IN_EXIT", "0")))
"""


def result_line(outcome: str = "published", code: int = 0, **fields: Any) -> str:
    base = {
        "schema_version": 1,
        "ok": code == 0,
        "outcome": outcome,
        "exit_code": code,
        "adapter_id": "support-bot",
        "version": "1.4.0",
        "lora_name": "support-bot@1.4.0-0123abcd",
        "sha256": "0123abcd" + "0" * 56,
        "event_id": "publish-1",
        "artifact_uri": "s3://b/acme/support-bot/1.4.0-0123abcd/",
        "error": None,
    }
    return json.dumps(base | fields) + "\n"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bin") / "loraplane"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return path


def run_script(
    stand_in: Path, tmp: Path, tag: str, *, stdout: str = "", code: int = 0, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[str] | None]:
    """Run the script for ``tag``; (its process, the arguments loraplane got or None)."""
    args_file = tmp / "args.json"
    args_file.unlink(missing_ok=True)
    base = {
        "PATH": os.environ["PATH"],
        "PUBLISH_CLI": str(stand_in),
        "PUBLISH_TENANT": "acme",
        "PUBLISH_BASE_MODEL": "tiny-llama",
        "PUBLISH_KEY_FILE": str(tmp / "ci.key"),
        "STAND_IN_ARGS": str(args_file),
        "STAND_IN_STDOUT": stdout,
        "STAND_IN_EXIT": str(code),
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), tag],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    got = json.loads(args_file.read_text()) if args_file.exists() else None
    return done, got


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


IDS = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,40}", fullmatch=True)
VERSIONS = st.from_regex(r"[0-9]{1,9}(\.[0-9]{1,9}){0,3}", fullmatch=True)


@settings(max_examples=10, deadline=None)  # two Python starts each: about 0.6 s on 2 cores
@given(IDS, VERSIONS, st.booleans())
def test_a_release_tag_becomes_the_adapter_id_and_version(
    stand_in: Path,
    tmp_path_factory: pytest.TempPathFactory,
    adapter_id: str,
    version: str,
    full_ref: bool,
) -> None:
    tmp = tmp_path_factory.mktemp("tag")
    tag = ("refs/tags/" if full_ref else "") + f"adapter/{adapter_id}/v{version}"
    done, args = run_script(stand_in, tmp, tag, stdout=result_line())
    assert done.returncode == 0, done.stderr
    assert args is not None and args[:2] == ["publish", "--json"]
    assert (option(args, "--adapter-id"), option(args, "--version")) == (adapter_id, version)
    assert option(args, "--artifact") == f"adapters/{adapter_id}"


@settings(max_examples=40, deadline=None)
@given(
    st.one_of(
        st.text(
            st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30
        ).filter(  # argv cannot hold NUL, nor a lone surrogate (no UTF-8 form)
            lambda t: not t.startswith(("adapter/", "refs/tags/adapter/"))
        ),
        st.builds(lambda a, b: f"adapter/{a}/{b}", IDS, VERSIONS),  # no "v"
        st.builds(lambda a, b: f"adapter/{a}/extra/v{b}", IDS, VERSIONS),
        st.just("adapter//v1"),
        st.just("adapter/bot/v"),
    )
)
def test_anything_else_is_refused_before_loraplane_runs(
    stand_in: Path, tmp_path_factory: pytest.TempPathFactory, tag: str
) -> None:
    tmp = tmp_path_factory.mktemp("bad")
    done, args = run_script(stand_in, tmp, tag, stdout=result_line())
    assert (done.returncode, done.stdout, args) == (2, "", None), done.stderr
    assert "is not adapter/<adapter_id>/v<version>" in done.stderr


@pytest.mark.parametrize("code", range(7))
def test_loraplanes_exit_code_and_result_pass_through(
    stand_in: Path, tmp_path: Path, code: int
) -> None:
    outcome = [
        "published",
        "internal_error",
        "invalid_input",
        "artifact_refused",
        "registry_rejected",
        "unavailable",
        "undecided",
    ][code]
    line = result_line(
        outcome,
        code,
        **(
            {}
            if code == 0
            else {
                "error": {
                    "code": "x",
                    "message": "refused: pickle_weights extra.bin\nsecond line",
                    "refusals": [],
                }
            }
        ),
    )
    outputs, summary = tmp_path / "outputs", tmp_path / "summary"
    done, _ = run_script(
        stand_in,
        tmp_path,
        "adapter/support-bot/v1.4.0",
        stdout=line,
        code=code,
        GITHUB_OUTPUT=str(outputs),
        GITHUB_STEP_SUMMARY=str(summary),
    )
    assert (done.returncode, done.stdout) == (code, line)
    written = dict(entry.split("=", 1) for entry in outputs.read_text().splitlines())
    assert written["outcome"] == outcome and written["lora_name"].startswith("support-bot@")
    last = done.stderr.splitlines()[-1]
    assert summary.read_text() == f"- {last.removeprefix('publish-adapter: ')}\n"
    if code:
        assert (
            f"not published ({outcome}, exit {code}): refused: pickle_weights extra.bin "
            "second line" in last
        )
    else:
        assert "published as support-bot@1.4.0-0123abcd" in last


def test_the_options_reach_loraplane(stand_in: Path, tmp_path: Path) -> None:
    done, args = run_script(
        stand_in,
        tmp_path,
        "adapter/bot/v2",
        stdout=result_line(),
        PUBLISH_ADAPTERS_DIR="/src/adapters",
        PUBLISH_PRIORITY="gold",
        PUBLISH_CANARY_PERCENT="10",
        PUBLISH_MODEL_CONFIG="/m/config.json",
        PUBLISH_WAIT_S="30",
        PUBLISH_RESULT_FILE=str(tmp_path / "result.json"),
        GITHUB_SHA="abcdef0123456789",
    )
    assert done.returncode == 0 and args is not None
    assert {
        o: option(args, o)
        for o in (
            "--tenant",
            "--base-model",
            "--key",
            "--artifact",
            "--priority",
            "--canary",
            "--model-config",
            "--wait-s",
            "--reason",
        )
    } == {
        "--tenant": "acme",
        "--base-model": "tiny-llama",
        "--key": str(tmp_path / "ci.key"),
        "--artifact": "/src/adapters/bot",
        "--priority": "gold",
        "--canary": "10",
        "--model-config": "/m/config.json",
        "--wait-s": "30",
        "--reason": "tag adapter/bot/v2 at abcdef012345",
    }
    assert (tmp_path / "result.json").read_text() == result_line()


def test_a_missing_requirement_or_result_is_an_error_not_a_success(
    stand_in: Path, tmp_path: Path
) -> None:
    done, args = run_script(stand_in, tmp_path, "adapter/bot/v2", PUBLISH_TENANT="")
    assert (done.returncode, args) == (2, None) and "PUBLISH_TENANT is not set" in done.stderr
    done, _ = run_script(stand_in, tmp_path, "adapter/bot/v2", stdout="", code=0)
    assert (done.returncode, done.stdout) == (1, "")  # exit 0 with no result is no success
    done, _ = run_script(stand_in, tmp_path, "adapter/bot/v2", stdout="", code=2)
    assert done.returncode == 2 and "no result from loraplane (exit 2)" in done.stderr
    done, _ = run_script(stand_in, tmp_path, "adapter/bot/v2", stdout="not json\n", code=0)
    assert done.returncode == 1 and "the result is not JSON" in done.stderr
