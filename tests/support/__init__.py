"""What the tests share that is not a test: strategies, the crash-state explorer and its race schedules, the
fault-injecting S3 proxy, the segment storage seam's conformance suite and its recording stand-in, the fork server for rank workers (prespawn), and the worker scripts that tests run
as processes of their own (``*_worker.py``, ``crash_writer.py``; each also runs as ``python tests/support/X.py``).
Tests import them as ``from support import crash_states`` (tests/ is on sys.path)."""
