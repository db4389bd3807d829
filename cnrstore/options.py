"""Per-store options: the tunables one open store reads, as leveldb's ``Options`` passed to ``DB::Open``.

``cnrstore.open(path, options=cnrstore.Options(segment_bytes=64 << 20))`` gives that store its own values;
two stores of one process may differ. Every field's default is the matching ``cnrstore.knobs`` value *when
the Options is made* (``Options()``, which ``open(options=None)`` makes), so that a test or an expert who
sets ``knobs.SEGMENT_BYTES`` before opening a store still changes it. An open store keeps the Options it
was opened with (``Store.options``) and never reads the knobs again. What the knobs hold that bounds the
on-disk format (``MAX_RECORD_BYTES``, ``MAX_SEGMENT_OFFSET``, ``MAX_BLOCK_ROWS``) and the LMDB reader table
shared by every process that opens a store (``INDEX_MAX_READERS``) stay in ``knobs``, not here.

docs/API.md ("Per-store options") lists the fields; knobs.py explains each value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import knobs
from .errors import InvalidArgument


def _knob(name: str):
    """A field whose default is ``knobs.<name>`` as it is when the Options is made."""
    return field(default_factory=lambda: getattr(knobs, name), metadata={"knob": name})


@dataclass(frozen=True)
class Options:
    """One store's tunables (module docstring). Frozen: ``dataclasses.replace(options, field=value)`` makes
    another. A value out of its range raises InvalidArgument naming the field and what it takes."""

    # segment log
    segment_bytes: int = _knob("SEGMENT_BYTES")
    writev_buffers: int = _knob("WRITEV_BUFFERS")
    # index
    index_map_bytes: int = _knob("INDEX_MAP_BYTES")
    # tables (the default block_rows of create_table)
    block_target_bytes: int = _knob("BLOCK_TARGET_BYTES")
    min_block_rows: int = _knob("MIN_BLOCK_ROWS")
    # writer
    encode_chunk_rows: int = _knob("ENCODE_CHUNK_ROWS")
    # trainer saves (cnrstore.torch's Checkpointer on this store)
    save_queue_state_fraction: float = _knob("SAVE_QUEUE_STATE_FRACTION")
    # compaction and GC
    gc_live_fraction: float = _knob("GC_LIVE_FRACTION")
    gc_space_bound: float = _knob("GC_SPACE_BOUND")
    gc_clean_max_live: float = _knob("GC_CLEAN_MAX_LIVE")
    # read chains and merges
    read_record_cost_s: float = _knob("READ_RECORD_COST_S")
    merge_trigger: float | None = _knob("MERGE_TRIGGER")
    read_amp_bound: float | None = _knob("READ_AMP_BOUND")
    read_chain_bound: int | None = _knob("READ_CHAIN_BOUND")
    merge_rate_bytes: int | None = _knob("MERGE_RATE_BYTES")
    merge_batch_bytes: int = _knob("MERGE_BATCH_BYTES")
    delta_reset_fraction: float = _knob("DELTA_RESET_FRACTION")
    delta_full_fraction: float = _knob("DELTA_FULL_FRACTION")
    delta_tier_ratio: float = _knob("DELTA_TIER_RATIO")
    # reads
    decode_threads: int | None = _knob("DECODE_THREADS")
    decode_inline_bytes: int = _knob("DECODE_INLINE_BYTES")
    mapped_read_release_bytes: int | None = _knob("MAPPED_READ_RELEASE_BYTES")
    # reads from an object store (remote=)
    remote_read_requests: int = _knob("REMOTE_READ_REQUESTS")
    remote_read_gap_bytes: int = _knob("REMOTE_READ_GAP_BYTES")
    remote_read_request_bytes: int = _knob("REMOTE_READ_REQUEST_BYTES")
    remote_read_window_bytes: int = _knob("REMOTE_READ_WINDOW_BYTES")

    def __post_init__(self) -> None:
        for name, (kind, low, high, optional, what) in _RULES.items():
            _check(name, getattr(self, name), kind, low, high, optional, what)
        if self.min_block_rows & (self.min_block_rows - 1):
            raise InvalidArgument(f"Options.min_block_rows must be a power of two, got {self.min_block_rows}; "
                                  f"pass e.g. min_block_rows={knobs.MIN_BLOCK_ROWS}")


#: field -> (int or float, least value, greatest value or None, whether None is allowed, what it is)
_RULES = {
    "segment_bytes": (int, 1, None, False, "bytes"),
    "writev_buffers": (int, 1, None, False, "buffers per writev call"),
    "index_map_bytes": (int, 1, None, False, "bytes"),
    "block_target_bytes": (int, 1, None, False, "bytes"),
    "min_block_rows": (int, 1, knobs.MAX_BLOCK_ROWS, False, "rows"),
    "encode_chunk_rows": (int, 1, None, False, "rows"),
    "save_queue_state_fraction": (float, 0.0, None, False, "a fraction of a full snapshot"),
    "gc_live_fraction": (float, 0.0, None, False, "a fraction of a segment"),
    "gc_space_bound": (float, 1.0, None, False, "times the live bytes"),
    "gc_clean_max_live": (float, 0.0, None, False, "a fraction of a segment"),
    "read_record_cost_s": (float, 0.0, None, False, "seconds"),
    "merge_trigger": (float, 1.0, None, True, "a read amplification"),
    "read_amp_bound": (float, 1.0, None, True, "a read amplification"),
    "read_chain_bound": (int, 1, None, True, "records"),
    "merge_rate_bytes": (int, 1, None, True, "bytes per second"),
    "merge_batch_bytes": (int, 1, None, False, "bytes"),
    "delta_reset_fraction": (float, 0.0, None, False, "a fraction of a block"),
    "delta_full_fraction": (float, 0.0, None, False, "a fraction of a block"),
    "delta_tier_ratio": (float, 0.0, None, False, "a ratio of rows"),
    "decode_threads": (int, 1, None, True, "threads"),
    "decode_inline_bytes": (int, 0, None, False, "bytes"),
    "mapped_read_release_bytes": (int, 0, None, True, "bytes"),
    "remote_read_requests": (int, 1, None, False, "requests in flight"),
    "remote_read_gap_bytes": (int, 0, None, False, "bytes"),
    "remote_read_request_bytes": (int, 1, None, False, "bytes"),
    "remote_read_window_bytes": (int, 1, None, False, "bytes"),
}


def _check(name: str, value, kind: type, low, high, optional: bool, what: str) -> None:
    """InvalidArgument unless ``value`` is a ``kind`` (an int for a float too; never a bool) within
    [``low``, ``high``], or None where ``optional``."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if (isinstance(value, bool) or not number or value != value or value < low
            or (high is not None and value > high)):
        default = getattr(knobs, _field(name).metadata["knob"])
        bound = f"at least {low}" + (f" and at most {high}" if high is not None else "")
        none = " (or None)" if optional else ""
        raise InvalidArgument(f"Options.{name} must be {'an int' if kind is int else 'a number'} {bound}{none}, "
                              f"{what}; got {value!r}: pass e.g. {name}={default!r}")


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(Options) if f.name == name)


def resolve(options) -> Options:
    """What ``open(options=...)`` takes: None (``Options()``, the knobs' current values) or an Options."""
    if options is None:
        return Options()
    if not isinstance(options, Options):
        raise InvalidArgument(f"options= takes a cnrstore.Options (or None), got {type(options).__name__}")
    return options
