"""Text the Java services of the stack read (Kafka, s3proxy): properties files and java
@argfiles, each escaped for the reader Java uses, so a value (a path, a password) reaches
the service as it was written."""

from __future__ import annotations

__all__ = ["argfile_text", "jaas_quoted", "properties_text"]

_PROPERTY_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f"}


def properties_text(props: dict[str, str]) -> str:
    """``props`` as a Java properties file, which Kafka reads as ISO-8859-1 with ``\\`` as
    an escape: every backslash, control and non-ASCII character of a value escaped (a home
    under ``/srv/opér`` or ``C:\\x`` named another folder), its leading blank kept."""

    def value(text: str) -> str:
        out = []
        for ch in text:
            if ch in _PROPERTY_ESCAPES:
                out.append(_PROPERTY_ESCAPES[ch])
            elif " " <= ch <= "~":
                out.append(ch)
            else:  # UTF-16 code units, as Java holds the string
                units = ch.encode("utf-16-be")
                out.extend(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2))
        escaped = "".join(out)
        return "\\" + escaped if escaped.startswith(" ") else escaped

    return "".join(f"{key}={value(v)}\n" for key, v in props.items())


def argfile_text(args: list[str]) -> str:
    """``args`` as a java @argfile, one quoted argument a line, its backslashes, quotes and
    controls escaped: unquoted, a path with a space was two arguments (``kafka-storage:
    unrecognized arguments``)."""
    escapes = {**_PROPERTY_ESCAPES, '"': '\\"'}
    return "".join('"' + "".join(escapes.get(ch, ch) for ch in a) + '"\n' for a in args)


def jaas_quoted(text: str) -> str:
    """``text`` as a quoted JAAS option value (``\\`` and ``"`` escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
