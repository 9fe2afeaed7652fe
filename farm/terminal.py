"""Text shown in a terminal: names and messages that came from users made inert."""

from __future__ import annotations

import unicodedata


def safe(text: object) -> str:
    """``text`` with every control character written out as an escape (``\\x1b``, ``\\u202e``).

    Job names, file names and failure messages come from users; printed raw, an escape
    sequence in one could clear the screen, retitle the window, fake other output or hide
    text (bidirectional overrides). Printable text, spaces included, is kept as it is.
    """
    out = []
    for ch in str(text):
        if ch == " " or (ch.isprintable() and unicodedata.category(ch) != "Cf"):
            out.append(ch)
        elif ord(ch) <= 0xFF:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}")
    return "".join(out)
