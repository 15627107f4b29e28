"""How the console shows values: pure helpers the templates call (no I/O)."""

from __future__ import annotations

import hmac
import string

DLQ_HEADER_PREFIX = "zb-dlq-"
_PRINTABLE = set(string.printable) - set("\x0b\x0c")


def show_bytes(data: bytes | None, limit: int = 2048) -> dict:
    """{"kind": "text"|"hex"|"null", "text": ..., "size": n, "cut": bool}. Text only when
    the bytes are UTF-8 made of printable characters; anything else as hex. The
    templates escape whatever comes out (autoescape), so text is never markup."""
    if data is None:
        return {"kind": "null", "text": "", "size": 0, "cut": False}
    data = bytes(data)
    cut = len(data) > limit
    head = data[:limit]
    try:
        text = head.decode("utf-8")
        if all(c in _PRINTABLE or c.isprintable() for c in text):
            return {"kind": "text", "text": text, "size": len(data), "cut": cut}
    except UnicodeDecodeError:
        pass
    return {"kind": "hex", "text": head.hex(" "), "size": len(data), "cut": cut}


def split_headers(headers: dict | None) -> tuple[list, list]:
    """(the record's own headers, the dead-letter provenance headers), each [(name, shown)]."""
    own, provenance = [], []
    for name, value in sorted((headers or {}).items()):
        (provenance if name.startswith(DLQ_HEADER_PREFIX) else own).append((name, show_bytes(value, 512)))
    return own, provenance


def dead_letter_topics(group: dict, topics: dict) -> list[str]:
    """The dead-letter topics of a group's topics (its `dlq`, else `<topic>.dlq`) that exist."""
    from zbroker.actors.group_coordinator.group_state import default_dlq_topic
    names = {p["topic"] for p in group.get("partitions", [])} | {
        t for mem in group.get("members", []) for t in mem.get("topics", [])}
    wanted = {group.get("dlq") or default_dlq_topic(t) for t in names}
    return sorted(t for t in wanted if t in topics)


def token_ok(expected: str | None, authorization: str | None, cookie: str | None) -> bool:
    """No token configured: open (loopback only, the CLI refuses otherwise). Else a
    bearer header or the console's cookie must carry it (compared in constant time)."""
    if not expected:
        return True
    given = None
    if authorization and authorization.startswith("Bearer "):
        given = authorization[len("Bearer "):].strip()
    elif cookie:
        given = cookie
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def parse_reset_target(text: str) -> str | int:
    """earliest, latest or an offset (the CLI's `groups reset --to`)."""
    text = text.strip()
    if text in ("earliest", "latest"):
        return text
    value = int(text)  # ValueError for anything else: the page says so
    if value < 0:
        raise ValueError("an offset is >= 0")
    return value


def human_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    s = ms / 1000
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
