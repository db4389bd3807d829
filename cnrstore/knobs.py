"""Defaults and tunables, in one place so tests (and experts) can override them.

Most of these are the defaults of a store's options (``cnrstore.Options``, cnrstore/options.py: the
lower-case field of each name): an ``Options()`` reads them as it is made, and ``cnrstore.open(path)``
makes one, so ``monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 4096)`` changes every store opened
after it; a store already open keeps its own values (``open(path, options=Options(segment_bytes=4096))``
gives one store its own). The bounds of the on-disk format (``MAX_RECORD_BYTES``, ``MAX_SEGMENT_OFFSET``,
``MAX_BLOCK_ROWS``) and ``INDEX_MAX_READERS`` are no options: modules read them here, at call time.
"""

# Segment log -------------------------------------------------------------------------------------
#: A segment is sealed and a new one started once it holds at least this many bytes.
SEGMENT_BYTES = 256 << 20
#: Largest single record (a record must fit the u32 length of an index entry).
MAX_RECORD_BYTES = (1 << 32) - 1
#: Largest offset a record may start at (index entries hold u32 offsets): one append that would place a
#: record beyond it continues in a new segment.
MAX_SEGMENT_OFFSET = (1 << 32) - 1

# Index -------------------------------------------------------------------------------------------
#: Initial LMDB map size. The map doubles on demand; no MapFullError reaches a caller.
INDEX_MAP_BYTES = 64 << 20
#: LMDB reader slots (one per concurrent read transaction, across processes).
INDEX_MAX_READERS = 256

# Tables ------------------------------------------------------------------------------------------
#: Default block_rows is the largest power of two whose block, encoded in the table's codec,
#: stays within this many bytes (clamped to [MIN_BLOCK_ROWS, MAX_BLOCK_ROWS]). Large blocks keep the
#: index small (one entry per touched block per version) and a read's per-record overhead low; the
#: price is that a point read verifies the checksum of whole records (~0.1 ms per 2 MiB).
BLOCK_TARGET_BYTES = 2 << 20
MIN_BLOCK_ROWS = 64
#: Row offsets inside a block are stored as u16, so a block holds at most 65536 rows.
MAX_BLOCK_ROWS = 1 << 16

# Writer ------------------------------------------------------------------------------------------
#: Rows encoded per codec call while writing; bounds the writer's transient memory.
ENCODE_CHUNK_ROWS = 1 << 18
#: Buffers handed to one writev call.
WRITEV_BUFFERS = 512

# Trainer saves (cnrstore.torch) -------------------------------------------------------------------
#: A Checkpointer's saves queue (a save copies its rows and returns while earlier ones are still being
#: written) as long as the host memory their snapshots hold stays within this fraction of a full snapshot
#: of the model (every row of every table and of its row-wise optimizer state, and the dense state); a save
#: that would pass the bound first waits for the oldest (a snapshot alone over it is taken once the queue is
#: empty). 0.25: increments queue freely, a baseline copied in full waits for the queue to drain, and a
#: streamed save (cnrstore/torch/streamed.py) holds only the rows changed while it is written.
#: ``Checkpointer(max_queue_bytes=...)`` sets the bound in bytes instead (0: one save at a time).
SAVE_QUEUE_STATE_FRACTION = 0.25

# Compaction and GC ---------------------------------------------------------------------------------
#: GC rewrites a sealed segment whose live records fill less than this fraction of it.
GC_LIVE_FRACTION = 0.5
#: GC goes on cleaning segments (best cost-benefit score first) while the disk would hold more than this
#: many times the live bytes (rows some retained version reads) ...
GC_SPACE_BOUND = 1.15
#: ... but never cleans a segment more live than this (its copy would cost more than it frees).
GC_CLEAN_MAX_LIVE = 0.95

# Read chains and merges (format 3; docs/DESIGN.md "Read chains, merges and read amplification") ----
#: Reads are bounded by what they cost. A record's read cost is its bytes plus its fixed cost: the time
#: of an index step, a header, a checksum set-up, an offsets check and its share of a block's gather (~11
#: us per record fitted on fp32 chains of 1-20 records here), in bytes of the table's codec decoded in
#: that time (READ_RECORD_COST_S x ``Codec.decode_bytes_per_s``: ~192 KB of fp32, ~10 KB of int4). A record
#: in another codec than the table's (a ``codec=`` override, a fallback, a merge mixing codecs: fp32) counts
#: at its own bytes. A block's *read amplification* at a version is the cost of its read chain there over
#: the cost of one baseline of the block (every row, in the table's codec, or the block's baseline record
#: — its oldest record if it has no baseline — if that is larger): about how much longer than a baseline's
#: its read takes.
READ_RECORD_COST_S = 12e-6
#: Background compaction merges a block once its read amplification at the newest version passes this:
#: the records above its baseline become one delta (or a delta on the cumulative delta, or a new baseline:
#: merge.py), written at that version under the same key, leaving it halfway between 1 and the trigger.
#: Lower: faster restores, more bytes written by merges (1,000 saves of 1% uniform int4 touches: all bytes
#: 2.1x the saves' own at 2.5; Zipf touches merge far less); None: no background merges.
MERGE_TRIGGER = 2.5
#: The hard bound on read amplification: every block at the newest version is within it after every
#: committed save and every maintenance step, whatever codecs its records are in. Enforced on the save path:
#: a save whose record of a block (priced in the codec it is written in) would pass it writes a merged delta
#: itself (what the background merge would have written, had it kept up), or a new baseline of the block
#: when no delta fits. Older versions keep what they had when newest, but for those between a version
#: ``compact(v)`` materializes and the newest (docs/DESIGN.md). None: no bound in bytes (READ_CHAIN_BOUND
#: still holds).
READ_AMP_BOUND = 3.0
#: The most records a read of any version walks for one block (a backstop against many tiny records),
#: enforced on the save path as READ_AMP_BOUND is; background merges start at MERGE_TRIGGER / READ_AMP_BOUND
#: of it. None: plain increments only, and no merges at all (chains grow until compaction materializes).
#: Earlier engines merged on every save at 3 (READ_CHAIN_BOUND = 3, READ_AMP_BOUND = None,
#: MERGE_TRIGGER = None): flat reads, but a save's bytes grew 4.7x over 20 versions.
READ_CHAIN_BOUND = 64
#: A keyed table's partition whose key runs above its baseline weigh this many times the baseline is merged
#: into a new baseline by the save that writes it next (engine/keyed_writer.py): a merge (about the baseline's
#: bytes) comes once per KEYED_MERGE_RATIO baselines' worth of changes, so merges add about
#: 1 / KEYED_MERGE_RATIO to what saves write (1.125x at 8), whatever share of the table a save changes; a read
#: of any version fetches at most about 1 + KEYED_MERGE_RATIO times the partition's bytes.
KEYED_MERGE_RATIO = 8.0
#: A save merges partitions due by KEYED_MERGE_RATIO while the baselines they rewrite stay within this share of
#: its own records' bytes (the others wait; at twice the ratio they merge anyway): merges add at most about
#: this much to a save's bytes, unless a single partition weighs more (engine/keyed_writer.py).
KEYED_MERGE_BUDGET = 0.18
#: ... and one whose read chain holds this many key runs is merged whatever their bytes (a backstop against
#: many tiny runs): a read walks at most this many records.
KEYED_CHAIN_BOUND = 128
#: A checkpoint holds up to this many bytes of keyed rows in memory before it appends them (keyed_writer.py):
#: the calls of one save that touch one partition then cost one record.
KEYED_BUFFER_BYTES = 256 << 20
#: Partitions of a keyed table created without ``partitions=``: about 2**16 live keys each at 6.7e7 keys.
DEFAULT_PARTITIONS = 1024
#: Background merges write at most this many bytes per second (a token bucket, RocksDB's RateLimiter in
#: miniature), so that they yield the disk to the trainer's saves; None: no limit.
MERGE_RATE_BYTES = 256 << 20
#: Background merges commit in batches of about this many bytes (each one index transaction).
MERGE_BATCH_BYTES = 64 << 20
#: Once the rows a block's cumulative deltas copied since its baseline reach this fraction of the block,
#: the next merge writes a new baseline of the block instead (Check-N-Run's reset, per block, on the real
#: union of changed rows; at 1.0 a ski-rental rule: copies never cost more than twice the best choice):
#: every row of the block, the untouched ones copied from the old baseline.
DELTA_RESET_FRACTION = 1.0
#: ... or once the merge would hold this fraction of the block anyway (a baseline then costs little more).
DELTA_FULL_FRACTION = 0.7
#: Two levels of deltas (merge.py): the records above a block's cumulative delta are merged into a delta on
#: it while they hold fewer rows than this many times it; else everything is merged into one cumulative
#: delta on the baseline.
DELTA_TIER_RATIO = 1.0

# Reads ---------------------------------------------------------------------------------------------
#: Threads that decode a whole-table read's blocks in parallel (read_table, read_tables, restore and the
#: torch Checkpointer's restore); None: every core this process may run on.
DECODE_THREADS = None
#: A read whose destinations hold fewer fp32 bytes than this is decoded on the caller's thread: handing
#: its blocks to the pool costs more than decoding them (a 256 KiB table of 16 blocks and 3 deltas: 1.24 ms
#: through the pool, 0.68 ms inline, on 2 cores).
DECODE_INLINE_BYTES = 1 << 20
#: Segments are read through mmap, and every page a read touches stays in the process's resident set (as
#: file-backed memory, RssFile) until the mapping goes. After this many bytes read, the reader drops its
#: mapped pages (``madvise(MADV_DONTNEED)``: the page cache keeps them, a later read faults them back in),
#: so a trainer whose saves merge read chains, or that restores a large store, does not count the store's
#: bytes in its peak RSS (without it, a 1.8 GiB trainer peaked at 3.9 GiB, 1.9 GiB of it mapped segments).
#: A whole-table read (restore) drops instead the pages of the records it is done with (verified, decoded),
#: after this many bytes of them, as it goes. None: never drop.
MAPPED_READ_RELEASE_BYTES = 64 << 20

# Reads from an object store (the remote tier: docs/DESIGN.md "The remote tier", "Planned reads") ----------
#: A whole-version read (read_tables, restore, the torch Checkpointer's restore) of segments that are in the
#: bucket only knows every record it needs from the index: it fetches them ahead with this many ranged GETs in
#: flight at once (a thread each). An object store serves one request at tens to a hundred MB/s and many in
#: parallel: 16 lanes keep a few hundred MB/s to a few GB/s in flight.
REMOTE_READ_REQUESTS = 16
#: The records of one segment lying at most this many bytes apart are fetched by one request, the bytes
#: between them included: a request costs a round trip (~10-50 ms on S3), in which a lane moves ~1 MiB.
REMOTE_READ_GAP_BYTES = 1 << 20
#: ... and such a run of records is cut into requests every this many bytes from its start (a record goes with the
#: request its start falls in: a request passes the size by at most one record). Large, so that a request's round
#: trip is small beside its transfer (a record is used as soon as its bytes land anyway: requests stream); small
#: enough that a restore of a few segments still spreads over the lanes. S3's guidance is ranges of 8-16 MB; moto
#: reads a whole object, under its lock, to serve any range of it, so there fewer and larger requests are faster
#: (a 1 GiB restore of 256 MiB segments from moto: 7.8-9.9 s in requests of 32 MiB, 4.3-8.3 s in 64 MiB, 3.3-4.5 s
#: in whole segments).
REMOTE_READ_REQUEST_BYTES = 64 << 20
#: A read into new arrays (read_tables with None, restore) holds at most this many bytes fetched and not yet
#: decoded (in flight, landed, or in the blocks being decoded): 16 lanes of 64 MiB. A request the read waits
#: for is fetched whatever the bound, so that a read never waits on itself. A read into the caller's arrays
#: verifies every record before it writes any, so it holds them all: its bound is the bytes it reads.
REMOTE_READ_WINDOW_BYTES = 1 << 30
