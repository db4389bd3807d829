"""The storage engine: the append-only segment log, its LMDB index and the one commit path.

Layers, lowest first (docs/ARCHITECTURE.md draws them):

* files — ``filenames``, ``fs`` (durable file operations), ``lock``, ``marker``, ``msgpack_safe``;
* the log — ``record`` (one record's bytes), ``blocks`` (row-to-block math), ``block_records`` (a
  block's ROWS records), ``segments`` (segment files), ``range_fetch`` (a planned read's records
  coalesced into requests and fetched concurrently ahead of it), ``storage`` (the segment storage seam
  and ``fetch``, the one checked read of a record), ``replication`` (the seam of what keeps a remote
  copy current: copy points), ``remote`` (the object-store tier behind both seams);
* the index — ``chain`` (the read-chain rule: which entry a read of a block walks next), ``index``
  (LMDB), ``schema`` (what its values hold), ``version_edit`` (what one commit changes: its log record
  and its index update);
* reads and writes — ``reader`` (read chains), ``table_decode`` (whole tables: every record verified,
  then decoded in parallel into place), ``merge`` (read cost and the merged deltas that bound it),
  ``chain_costs`` (each block's chain cost, remembered for the save path), ``arguments`` (the checks of
  a caller's arguments), ``writer`` (a checkpoint);
* the engine — ``opening`` (finding and making a store's files), ``core`` (``Engine``: the lock, the
  index, recovery, the appenders and the writer slot, all private), ``parts`` (what the writer and the
  maintenance handle are handed) and ``handle`` (the maintenance handle: ``with engine.maintenance() as
  m``).

Nothing here imports ``cnrstore.maintenance``, ``cnrstore.store`` or a wing (tests/test_engine.py).
"""

from .core import Engine, version_info

__all__ = ["Engine", "version_info"]
