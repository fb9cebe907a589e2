"""Attack tests: YAML whose aliases expand past any real file ("billion laughs") or refer to
themselves is refused before anything walks it, by every reader of operator YAML (settings,
keyring, schedules); plain YAML, anchors included, loads as ``yaml.safe_load`` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from loraplane.schemas.bounded_yaml import YamlTooLarge, load_yaml


def laughs(levels: int, width: int = 2) -> str:
    """Anchors that each repeat the previous one ``width`` times: ``width**levels`` leaves."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


BOMB = laughs(21)  # 2**21 leaves: a few hundred bytes, over a million nodes
SMALL = laughs(4)

leaves = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
documents = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=30,
)


@given(documents)
def test_plain_yaml_loads_as_safe_load_does(document: Any) -> None:
    text = yaml.safe_dump(document)
    assert load_yaml(text) == yaml.safe_load(text)


def test_anchors_that_share_a_block_load_as_safe_load_does() -> None:
    text = SMALL + "defaults: &d {retries: 3}\nfirst: *d\nsecond: {<<: *d, retries: 4}\n"
    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml("") is None


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(BOMB + "top: *l20\n", id="billion-laughs"),
        pytest.param(laughs(3, width=200), id="wide-laughs"),
        pytest.param("a: &a [*a]\n", id="list-holding-itself"),
        pytest.param("a: &a {b: *a}\n", id="mapping-holding-itself"),
        pytest.param("[" * 5000 + "]" * 5000, id="nested-past-the-recursion-limit"),
    ],
)
def test_an_expanding_or_self_referring_document_is_refused(text: str) -> None:
    with pytest.raises(YamlTooLarge):
        load_yaml(text)


def test_the_bound_counts_expanded_nodes() -> None:
    # 16 leaves, 8 + 4 + 2 + 1 lists and the anchored chain under its keys: within 200.
    assert load_yaml(SMALL, max_nodes=200) is not None
    with pytest.raises(YamlTooLarge, match="more than 20 nodes"):
        load_yaml(SMALL, max_nodes=20)


# ---- each reader of operator YAML -------------------------------------------------------
def test_a_schedule_file_of_laughs_is_refused() -> None:
    from loraplane.streams.schedules import parse_schedule

    with pytest.raises(YamlTooLarge):
        parse_schedule(BOMB + "schedules: *l20\n")


def test_a_keyring_of_laughs_is_a_keyring_error() -> None:
    from loraplane.schemas.keyring import KeyringError, parse_keyring

    with pytest.raises(KeyringError, match="aliases"):
        parse_keyring(BOMB + "tenants: {acme: {ceiling: *l20}}\n")


def test_a_settings_file_of_laughs_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.kernel.config import Settings

    config = tmp_path / "loraplane.yaml"
    config.write_text(BOMB + "kafka: {port: *l20}\n")
    monkeypatch.setenv("LORAPLANE_CONFIG", str(config))
    with pytest.raises(YamlTooLarge):
        Settings()
