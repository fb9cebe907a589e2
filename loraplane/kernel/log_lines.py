"""Every log line a loraplane process writes is one line.

A message may carry text from outside (vLLM's refusal quoting a client's field value, an
upstream's error, a record read from a topic): a newline in it would start a line of the
log that loraplane never wrote, one an operator or a log shipper reads as its own record.
The formatter escapes line breaks and other control characters in the message as Python
escapes (``\\n``, ``\\x1b``), and so the bidirectional formatting characters, which make
a terminal or an editor show the text after them in another order than it was written
(``\\u202e``); a traceback, appended after the message, keeps its lines.

Two rules, for two kinds of text: a log line (``one_line``) keeps tabs and every printable
character of any script, as a message in any language reads; a name quoted to a terminal or
a CI log (``shown``: a file name in an artifact, an object key) is shown as Python's
``repr`` spells it whenever any character of it is not printable (an invisible character in
a name would make two different names look the same).
"""

from __future__ import annotations

import logging
import re

__all__ = ["FORMAT", "OneLineFormatter", "configure_logging", "one_line", "shown"]

FORMAT = "%(asctime)s %(name)s %(message)s"
_BREAKING = re.compile(
    r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
"""C0 and C1 controls but tab, Unicode's line and paragraph separators, and its
bidirectional marks, embeddings, overrides and isolates."""


def one_line(text: str) -> str:
    """``text`` with every line break, control and bidirectional formatting character
    escaped."""
    return _BREAKING.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def shown(text: str) -> str:
    """``text`` as a terminal or a CI log may print it: escaped (``repr``) unless every
    character is printable (no line break, control, escape or direction override)."""
    return text if text.isprintable() else repr(text)[1:-1]


class OneLineFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose message part is always one line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return one_line(super().formatMessage(record))


def configure_logging(level: int = logging.INFO, fmt: str = FORMAT) -> None:
    """The root logger of a loraplane process: ``level``, to stderr, one line a record."""
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OneLineFormatter(fmt))
