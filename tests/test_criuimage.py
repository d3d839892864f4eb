"""The protobuf wire-format helpers CRIU's images and streamer requests are read with."""

from __future__ import annotations

import pytest

from warmctl.checkpoint import criuimage


@pytest.mark.parametrize("v", [0, 1, 127, 128, 300, 2**32 + 5, 2**64 - 1])
def test_a_varint_reads_back_what_was_written(v):
    b = criuimage.uvarint(v) + b"tail"
    assert criuimage.varint(b, 0) == (v, len(b) - 4)


def test_fields_by_wire_type_in_order():
    m = (criuimage.varint_field(1, 7) + b"\x12\x03abc" + criuimage.varint_field(1, 300)
         + b"\x19" + bytes(range(8)) + b"\x25" + b"wxyz")
    assert criuimage.fields(m) == {1: [7, 300], 2: [b"abc"], 3: [bytes(range(8))], 4: [b"wxyz"]}


@pytest.mark.parametrize("bad, words", [
    (b"\x08", "runs past"),                          # a varint cut short
    (b"\x08" + b"\xff" * 10 + b"\x01", "64 bits"),   # an 11-byte varint
    (b"\x12\x05abc", "run past"),                    # a string longer than the message
    (b"\x19abc", "run past"),                        # a 64-bit field cut short
    (b"\x0b", "wire type 3"),                        # a group
])
def test_a_malformed_message_is_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        criuimage.fields(bad)
