"""Wire protocol v1: typed messages, the frame codec, record batches and errors.

This package is the only place frames are packed or unpacked. See docs/PROTOCOL.md.
"""

from zbroker.protocol.codec import (Envelope, decode_any, decode_reply, decode_request, encode_error,
                            encode_reply, encode_request)
from zbroker.protocol.errors import ErrorCode, ProtocolError, ZBrokerError
from zbroker.protocol.messages import PROTOCOL_VERSION, SUPPORTED_VERSIONS

__all__ = [
    "Envelope", "decode_any", "decode_reply", "decode_request", "encode_error", "encode_reply",
    "encode_request", "ErrorCode", "ProtocolError", "ZBrokerError", "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
]
