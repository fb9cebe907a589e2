"""The properties files and @argfiles the stack writes for Java read back as written."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from loraplane.infra.java_text import argfile_text, jaas_quoted, properties_text

_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "f": "\f"}


def _java_value(escaped: str) -> str:
    """A value as java.util.Properties.load reads it from ISO-8859-1 bytes."""
    out: list[str] = []
    i = 0
    while i < len(escaped):
        ch = escaped[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        nxt = escaped[i + 1]
        if nxt == "u":
            out.append(chr(int(escaped[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(_SIMPLE.get(nxt, nxt))
            i += 2
    return "".join(out).encode("utf-16-be", "surrogatepass").decode("utf-16-be")


@given(st.text(st.characters(exclude_categories=("Cs",))))
def test_a_property_value_reads_back_as_written(value: str) -> None:
    text = properties_text({"log.dirs": value})
    text.encode("ascii")  # Kafka and s3proxy read the file as ISO-8859-1
    (line,) = text.splitlines()
    key, _, escaped = line.partition("=")
    assert key == "log.dirs"
    assert _java_value(escaped.lstrip(" \t\f")) == value  # Java drops a value's leading blanks


def test_a_path_with_a_space_quote_or_backslash_is_one_argfile_argument() -> None:
    text = argfile_text(['/srv/ops data/x"y\\z', "format"])
    assert text == '"/srv/ops data/x\\"y\\\\z"\n"format"\n'
    assert re.fullmatch(r'"(\\\\|\\"|[^"\\])*"', jaas_quoted('p"w\\d'))
