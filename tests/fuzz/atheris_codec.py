"""Coverage-guided (atheris/libFuzzer) fuzz of the protocol decoders.

Run by tests/fuzz/test_codec_fuzz.py, or by hand for longer::

    python -m tests.fuzz.atheris_codec -max_total_time=600 CORPUS_DIR

The first input byte picks the target; the rest is split into frames at 0xFE
0xFE 0xFE markers (so libFuzzer can learn multi-frame messages). An exception
other than ProtocolError/CorruptBatch, or a broken invariant, is a crash.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from tests.fuzz import codec_targets as tgt

SEPARATOR = b"\xfe\xfe\xfe"


def one_input(data: bytes) -> None:
    if not data:
        return
    target, body = data[0] % 5, data[1:]
    frames = body.split(SEPARATOR)[:7]
    if target == 0:
        tgt.check_request(frames)
    elif target == 1:
        tgt.check_reply(frames)
    elif target == 2:
        tgt.check_any(frames)
    elif target == 3:
        tgt.check_stored(body, verify_crc=True)
        tgt.check_stored(tgt.recrc(body), verify_crc=True)
    else:
        tgt.check_payload(body)
        tgt.check_stored(tgt.stored(body), verify_crc=False)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
