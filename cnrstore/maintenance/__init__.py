"""Maintenance: the work that rewrites or checks a store after its versions are committed.

* ``liveness`` — which rows of each record some retained version still reads;
* ``compaction`` — materializing baselines, dropping versions, garbage-collecting segments;
* ``background`` — the thread that runs compaction off the trainer's path;
* ``verify`` — fsck: every checksum of live data and the index against the log;
* ``repair`` — rebuilding a damaged store's index from its log.

Each commits through the engine's one path (the maintenance handle's ``m.commit`` of a ``VersionEdit``); nothing here
imports ``cnrstore.store`` or a wing (tests/test_engine.py).
"""
