"""Triton's BYTES tensor on the wire: each element is a 4-byte little-endian length, then its bytes.

The one owner of that format in rtk: the warm-up files of emitted repositories, the front door's
requests and responses and the SLO client's responses all go through these two functions (what
``tritonclient.utils.serialize_byte_tensor`` / ``deserialize_bytes_tensor`` do, without numpy arrays).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

_UINT32 = struct.Struct("<I")


def bytes_tensor(items: Iterable[bytes]) -> bytes:
    """The raw contents of a BYTES tensor holding ``items``."""
    return b"".join(_UINT32.pack(len(b)) + b for b in items)


def bytes_elements(raw: bytes) -> list[bytes]:
    """The elements of a raw BYTES tensor."""
    out, i, end = [], 0, len(raw)
    while i < end:
        (n,) = _UINT32.unpack_from(raw, i)
        i += 4
        if i + n > end:
            raise ValueError(f"BYTES element of {n} bytes at offset {i} runs past the {end}-byte tensor")
        out.append(raw[i : i + n])
        i += n
    return out
