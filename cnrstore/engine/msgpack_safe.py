"""Bounded msgpack decoding of bytes a store holds (docs/DESIGN.md "Security").

Every msgpack object cnrstore reads from disk (index values, DENSE descriptors, COMMIT / ANCHOR / DROP
bodies, distributed markers, plans and manifests) goes through :func:`unpack_bounded`: each length a
header claims is limited by the bytes actually there (``max_str_len`` ... ``max_map_len``), extension
types are refused (a store holds none: msgpack's Timestamp and ExtType would be objects, not data), and
every failure -- msgpack's own errors, an unhashable map key, nesting deeper than msgpack's stack -- is one
typed :class:`CorruptionError`. A crafted value of n bytes costs memory proportional to n.
"""

from __future__ import annotations

import msgpack

from ..errors import CorruptionError

__all__ = ["unpack_bounded"]


def _no_ext(code: int, data: bytes):
    raise ValueError(f"msgpack extension type {code} (a store holds no extension types)")


def unpack_bounded(data, path: str | None = None, offset: int | None = None, *, what: str = "msgpack value"):
    """The object ``data`` (bytes-like) encodes; CorruptionError (with ``path``, ``offset``) for anything
    that is not exactly one well-formed msgpack object within the limits above."""
    data = bytes(data)
    n = len(data)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=_no_ext,
                               max_str_len=n, max_bin_len=n, max_array_len=n,
                               max_map_len=n // 2, max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - msgpack raises ValueError, TypeError, ExtraData, StackError ...
        where = f" in {path}" + (f" at offset {offset}" if offset is not None else "") if path else ""
        raise CorruptionError(f"{what}{where} does not decode ({type(exc).__name__}: {exc})", path, offset) from None
