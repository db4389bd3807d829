"""Changing an open store's options between two of its operations, for tests that need one tunable to differ
mid-run (a save that must merge past a bound the earlier saves did not have). A store's options are fixed
at open (cnrstore/options.py); these tests swap the engine's for the ``with`` block. What the segment
appenders took at open (``segment_bytes``, ``writev_buffers``) and the index's map size do not follow."""

from __future__ import annotations

import contextlib
import dataclasses


@contextlib.contextmanager
def options_changed(store, **changes):
    """Within it, ``store`` (an open Store) reads ``changes`` in place of those fields of its options."""
    engine = store.engine
    before = engine.options
    engine._options = dataclasses.replace(before, **changes)  # (white-box: the engine exposes no setter)
    try:
        yield engine.options
    finally:
        engine._options = before
