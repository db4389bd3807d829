"""Codec registry: look a codec up by name (API) or by the id stored in each record (on disk).

Ids are part of the on-disk format: never renumber one, never reuse a retired one. Assigned: fp32=1,
fp16=2, int8=3, int4=4, int2=5, int1=6, int3=7, int5=8, int6=9, int7=10, adaptive2=11, adaptive3=12,
adaptive4=13, kmeans2=14, kmeans3=15, kmeans4=16. Ids 17..255 are free.
"""

from __future__ import annotations

import operator

from cnrstore.codecs.adaptive import Adaptive2, Adaptive3, Adaptive4
from cnrstore.codecs.base import Codec
from cnrstore.codecs.kmeans import KMeans2, KMeans3, KMeans4
from cnrstore.codecs.lossless import FP16, FP32
from cnrstore.codecs.nbit import Int1, Int3, Int5, Int6, Int7
from cnrstore.codecs.rowwise import Int2, Int4, Int8, value_range
from cnrstore.errors import InvalidArgument

__all__ = ["Codec", "names", "get", "by_id", "value_range"]

_CODECS: tuple[Codec, ...] = (FP32(), FP16(), Int8(), Int4(), Int2(), Int1(), Int3(), Int5(), Int6(), Int7(),
                              Adaptive2(), Adaptive3(), Adaptive4(), KMeans2(), KMeans3(), KMeans4())
_BY_NAME: dict[str, Codec] = {c.name: c for c in _CODECS}
_BY_ID: dict[int, Codec] = {c.codec_id: c for c in _CODECS}
if len(_BY_NAME) != len(_CODECS) or len(_BY_ID) != len(_CODECS):  # pragma: no cover - a coding error
    raise ImportError("cnrstore.codecs: duplicate codec name or id")
if not all(0 < c.codec_id < 256 and (c.fallback is None or c.fallback in _BY_NAME) for c in _CODECS):
    raise ImportError("cnrstore.codecs: codec id out of u8 range or unknown fallback")  # pragma: no cover


def names() -> list[str]:
    """Names of all codecs, in id order."""
    return list(_BY_NAME)


def get(name: str) -> Codec:
    """The codec called ``name``; :class:`InvalidArgument` listing the known names if there is none."""
    codec = _BY_NAME.get(name) if isinstance(name, str) else None
    if codec is None:
        raise InvalidArgument(f"unknown codec {name!r}; known codecs: {', '.join(_BY_NAME)}")
    return codec


def by_id(codec_id: int) -> Codec:
    """The codec whose on-disk id is ``codec_id``; :class:`InvalidArgument` if there is none."""
    try:
        codec = _BY_ID.get(operator.index(codec_id))
    except TypeError:
        codec = None
    if codec is None:
        known = ", ".join(f"{c.codec_id} ({c.name})" for c in _CODECS)
        raise InvalidArgument(
            f"unknown codec id {codec_id!r}; this cnrstore knows {known}: data written by a newer "
            "cnrstore needs a newer cnrstore"
        )
    return codec
