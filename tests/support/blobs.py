"""Bytes with a short repr, for Hypothesis strategies that draw large values.

Hypothesis builds the repr of an example's arguments (to report it, and on some
runs for each example), and warns when it passes 30,000 characters. Under the
suite's `filterwarnings = error` that warning fails the test: a list of forty
70,000-byte values did so once in a helper's run. The bytes are unchanged; only
their repr is cut to their length and first bytes.
"""

from __future__ import annotations


class Blob(bytes):
    def __repr__(self) -> str:
        if len(self) <= 32:
            return bytes.__repr__(self)
        return f"Blob({bytes(self[:16])!r} + {len(self) - 16} bytes more)"
