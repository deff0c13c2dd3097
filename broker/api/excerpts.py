"""Short excerpts of untrusted values, for error messages.

An error message that echoes a whole bad value lets one small request produce a huge answer (an
expanded YAML alias bomb once came back as a 312 MB 400). Django's `Truncator.chars` is not used:
it does not count combining characters, so a body made of them would come back whole.
"""
from __future__ import annotations

ELLIPSIS = "…"
MESSAGE_CHARS = 200  # longest error message the API sends
VALUE_CHARS = 40  # longest piece of a user's value quoted inside a message


def excerpt(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` cut to at most `limit` characters, with an ellipsis when something was cut."""
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def quoted(value: object, limit: int = VALUE_CHARS) -> str:
    """A user's value as a short, printable Python-style literal: `'ab…'`.

    repr() escapes NUL, lone surrogates and other unprintable characters, so the result is always
    safe to put in a JSON answer (a raw lone surrogate cannot be encoded as UTF-8).
    """
    if isinstance(value, str):
        return repr(value[:limit]) + (ELLIPSIS if len(value) > limit else "")
    try:
        return excerpt(repr(value), limit)
    except ValueError:  # an int too long to print (sys.get_int_max_str_digits)
        return f"<{type(value).__name__}>"
