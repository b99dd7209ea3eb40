/* The local store of store.h on SQLite: the schema, statements prepared once at open, one
 * transaction per loop turn, message records journaled per turn and folded into segments
 * per conversation, and conversations rebuilt from them. */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "buf.h"
#include "ddbitem.h"
#include "log.h"
#include "monoclock.h"
#include "msgrec.h"
#include "ops.h"
#include "pagecache.h"
#include "siphash.h"
#include "walcheck.h"
#include "walvfs.h"

#define STORE_FILE "convod.db"
/* 2: the journal table; 3: batches and segments instead of the messages table; 4: packed
 * records (msgrec.h), about half the size (an older convod would take them for damage);
 * 5: a second table of batches, batches1 (see "Messages" below); 6: an index of the dead
 * letters by message, so that a load finds a message's dead-lettered version; 7: the
 * repairs table (the sink's writes without a clear answer, looked at again after a
 * restart too) */
#define STORE_SCHEMA_VERSION 7
#define STORE_APPLICATION_ID 0x636e7664 /* "cnvd": tells our files from other SQLite files */
#define STORE_BUSY_TIMEOUT_MS 100
#define STORE_BUF_KEEP (1024 * 1024) /* larger buffers are freed after use */
/* WAL pages (64 MB) after which the checkpointer thread copies the WAL into the database;
 * an idle daemon has it copied too (store_idle). SQLite's own automatic checkpoint runs at
 * 1000, inside the commit. Pages written again before a round are copied once: the fold's
 * batches reuse the pages earlier batches freed, and every commit writes the first page
 * and the tables' inner pages. Fewer rounds also sync less, at durability machine too.
 * Paired runs, 50 connections, 1000 -> 16000 pages: p1 133k -> 155k req/s (medians of 5),
 * p16 396k -> 426k (of 6), machine 85k -> 92k (of 3). */
#define STORE_CHECKPOINT_PAGES 16000
/* Under continuous writes the thread's checkpoints never catch up with the WAL's end, and
 * SQLite starts the WAL over only after a checkpoint that did. Past this size (128 MB) the
 * writer thread, after a commit, waits for the checkpoint thread's round to end and runs
 * one itself, with no commit in between: it copies all the thread has not, and the next
 * commit starts the WAL over. That wait is the back-pressure that bounds the WAL when
 * writes outrun the thread; the loop meanwhile hands its commits to the writer. (Without
 * waiting, the checkpoint got SQLITE_BUSY or rarely found the thread idle, and a RESTART
 * from the thread starved behind the commits: the WAL grew past 100 MB in the store's unit
 * test.) A larger bound makes these waits rarer, not longer. */
#define STORE_WAL_HARD_PAGES 32000
/* A checkpoint round that left at most this many frames behind it (those of the commits
 * made meanwhile) is the last: the next commit copies them (checkpoint_catch_up), a few
 * hundred us on the loop, instead of another round. */
#define STORE_CATCH_UP_PAGES 256
/* At durability process, after every this many pages (4 MB) of WAL the checkpoint thread
 * starts the writeback of the WAL's dirty pages without waiting for it (wal_writeback).
 * Nothing else writes them before a sync: the checkpoint round's sync of the WAL then wrote
 * up to 64 MB at once, and the small syncs on the loop (the catch-up's, the commit that
 * starts the WAL over) waited behind that burst at the disk, up to 155 ms each. 12 paired
 * runs, 50 connections, adds only, 10 s: p99 lower in 9 (means 3.8 -> 3.2 ms), p99.9 in 10
 * (12.2 -> 10.5 ms), req/s higher in 8 (65.9k -> 68.1k); the loop's time blocked in the
 * kernel fell from 77-568 to 43-190 ms in 6 s (5 pairs). 256 and 4096 pages did no better. */
#define STORE_WAL_WRITEBACK_PAGES 1024
/* Pending records after which a fold cycle starts (see "Messages" below). A segment per
 * conversation and cycle costs about a page of WAL beyond its records (the index, the
 * table's inner pages), so fewer, longer segments write less: 16384 -> 65536 at 1000
 * conversations, 0.12 -> 0.09 WAL pages per record folded, and in paired runs at a
 * pipeline of 16, 442k -> 489k req/s (medians of 4), with JSON records. Packed records
 * (schema 4) write half as much, and longer cycles then cost the tail more than they
 * gain: paired runs at 50 connections, 6 each, 65536 -> 32768: p1 p99 0.93 -> 0.82 ms
 * (medians) and max 26-39 -> 14-23 ms at the same req/s, p16 516k -> 479k; 131072 gave
 * p1 164k -> 172k req/s but p99 1.02 -> 1.09 ms and max 44-51 ms. Pending records are
 * at most half as many as at 65536 (see STORE_FOLD_BEHIND), each about half the size. */
#define STORE_FOLD_RECORDS 32768
/* The fold's steps, in transactions of their own while the writer has nothing to write:
 * about this many records each. A step ends early, after the segment it is writing, once a
 * job is queued (jobs_waiting), so a commit waits behind one segment and the step's own
 * commit, not the whole step; longer steps rewrite the pages every transaction touches
 * (the first page, the tables' inner pages, the index leaves of neighbouring conversations)
 * less often. 128 -> 1024, six paired runs at a pipeline of 16, 50 connections: the writer
 * thread's CPU a request 1.90-2.36 -> 1.59-1.92 us; p99 (11.9-18.4 ms) and, without
 * pipelining, req/s showed no change past the noise. */
#define STORE_FOLD_IDLE_STEP 1024
/* Pending records past which each commit takes a step of the fold too (at least this many
 * records): the back-pressure that bounds the memory pending records take. A step of 16
 * records at least, so that more commits fold less each (about one segment, none of 64):
 * 12 paired runs at 50 connections, process: p99 lower in 5, req/s higher in 7 (means
 * 0.94 -> 0.98 ms, 169k -> 167k); not taken. */
#define STORE_FOLD_BEHIND(s) (4 * (s)->fold_records)
#define STORE_FOLD_STEP_MIN 64
/* How long after a commit at durability machine the writer may wait for the requests its
 * answers released (cohort_wait). 50 connections, adds only, 8 s runs: 44.0k req/s, 21
 * records a commit, p99 3.5 ms without; 200 us: 46.1k; 400 us: 45.5-51.8k, 37-43 records a
 * commit, p99 2.5-2.9 ms, 15-17 us of CPU a request instead of 18. At 4 connections 6.5k ->
 * 9.5k req/s, p99 1.4 -> 0.75 ms. A commit there takes about 470 us. */
#define STORE_COHORT_WAIT_NS 400000u
/* At durability process the loop writes a commit itself (no thread wake-up either way)
 * when the writer has nothing under way and the commit is at most this many records; a
 * bigger one means a busy loop, which is better off handing it over. */
#define STORE_INLINE_RECORDS 64

/* Messages. A group commit adds message versions to many conversations at once. Stored
 * one row per message in a table keyed by (conversation, sk), each message dirtied a page
 * per conversation and turn (4 kB of WAL per add at 50 connections); appended to a journal
 * and folded into that table in batches, the fold cost 3-4 us per message and stalled the
 * loop 35-60 ms each time. So now:
 *
 * - A turn's message records (msgrec.h) are one row of `batches`, written in its commit:
 *   a few pages of WAL per turn, whatever the conversations.
 * - Committed batches stay in memory (the pending records) until folded. A fold cycle
 *   starts once STORE_FOLD_RECORDS records are pending: it sorts them by conversation and,
 *   a few conversations after each commit (in that commit's transaction, so that the loop
 *   never stalls on a whole fold), writes one row of `segments` per conversation with its
 *   records, the newest version of each message. A crash before its batches are gone
 *   leaves batches that the next start folds again; segments written twice hold the same
 *   versions or older ones.
 * - The batches go to two tables, `batches` and `batches1`, in turns: those of the next
 *   cycle to one, so that the other holds only those of the cycle under way, or of the
 *   last one, which ended. Once a cycle ended, the first commit or idle step of the writer
 *   after it empties its table with one statement (SQLite's truncate, which frees the
 *   table's pages without deleting its rows one by one); its pages go to the free list,
 *   where the next batches find them. Schema 4 had one table, whose folded batches later
 *   commits deleted a few rows each (all at once, 6-15 ms). Paired runs at 50
 *   connections, durability process, 12 pairs: the loop's CPU a request lower in 11
 *   (means 7.11 -> 6.60 us), p99 lower in 10 (1.22 -> 1.11 ms). Under load a cycle's
 *   table holds 3,300-3,800 batches, emptied in 3-5 ms (once 13.5 ms) on the loop, once a
 *   cycle (about a second).
 * - A conversation is its segments, in order, then its pending records; the highest
 *   version of each message wins. Reading one (store_load_conversation) merges them and
 *   never writes: it is what rebuilds memory after a failed commit, when the disk may be
 *   full. store_open folds whatever batches a crash left, before anything is read.
 *
 * closed = 0 while open, else the Unix ms of the close. The spool's unique key starts with
 * sk, whose ULIDs grow with time, so that new spool rows are appended; its map_bytes is the
 * message map's size when spooled (for the statistics). `confirmed` holds the versions
 * DynamoDB confirmed. */
static const char schema_sql[] =
    "CREATE TABLE conversations("
    " id BLOB PRIMARY KEY NOT NULL,"
    " updated INTEGER NOT NULL,"
    " closed INTEGER NOT NULL DEFAULT 0"
    ") WITHOUT ROWID;"
    "CREATE TABLE spool("
    " seq INTEGER PRIMARY KEY,"
    " conversation BLOB NOT NULL,"
    " sk TEXT NOT NULL,"
    " version INTEGER NOT NULL,"
    " enqueued INTEGER NOT NULL,"
    " map_bytes INTEGER NOT NULL DEFAULT 0,"
    " UNIQUE(sk, conversation)"
    ");"
    "CREATE TABLE dead_letters("
    " seq INTEGER PRIMARY KEY,"
    " conversation BLOB NOT NULL,"
    " sk TEXT NOT NULL,"
    " version INTEGER NOT NULL,"
    " item TEXT,"
    " error TEXT NOT NULL,"
    " at INTEGER NOT NULL"
    ");";
/* The tables of schema 3 that schema 2 did not have, of 5 that 4 did not have, and the index
 * of 6 (created by the upgrades too). */
static const char schema3_sql[] = "CREATE TABLE batches("
                                  " seq INTEGER PRIMARY KEY,"
                                  " data BLOB NOT NULL"
                                  ");"
                                  "CREATE TABLE segments("
                                  " seq INTEGER PRIMARY KEY,"
                                  " conversation BLOB NOT NULL,"
                                  " data BLOB NOT NULL"
                                  ");"
                                  "CREATE INDEX segments_by_conversation"
                                  " ON segments(conversation, seq);"
                                  "CREATE TABLE confirmed("
                                  " conversation BLOB NOT NULL,"
                                  " sk TEXT NOT NULL,"
                                  " version INTEGER NOT NULL,"
                                  " PRIMARY KEY(conversation, sk)"
                                  ") WITHOUT ROWID;";
static const char schema5_sql[] = "CREATE TABLE batches1("
                                  " seq INTEGER PRIMARY KEY,"
                                  " data BLOB NOT NULL"
                                  ");";
static const char schema6_sql[] = "CREATE INDEX IF NOT EXISTS dead_letters_by_message"
                                  " ON dead_letters(conversation, sk, version);";
/* A message whose write of `version` may still land late, to look at again at `due` (Unix
 * ms): sink.c, repair_add. */
static const char schema7_sql[] = "CREATE TABLE IF NOT EXISTS repairs("
                                  " conversation BLOB NOT NULL,"
                                  " sk TEXT NOT NULL,"
                                  " version INTEGER NOT NULL,"
                                  " due INTEGER NOT NULL,"
                                  " PRIMARY KEY(conversation, sk, version)"
                                  ") WITHOUT ROWID;";

enum stmt_id {
	ST_BEGIN = 0,
	ST_COMMIT,
	ST_ROLLBACK,
	ST_BATCH_PUT,  /* into batches */
	ST_BATCH_PUT1, /* into batches1 */
	ST_BATCH_CLEAR,
	ST_BATCH_CLEAR1,
	ST_BATCH_EACH,
	ST_SEGMENT_PUT,
	ST_SEGMENTS_OF,
	ST_SEGMENTS_NEWEST,
	ST_CONVERSATION_GET,
	ST_PUT_CONVERSATION,
	ST_SET_CLOSED,
	ST_OPEN_EACH,
	ST_SPOOL_PUT,
	ST_SPOOL_DELETE,
	ST_SPOOL_VERSION,
	ST_CONFIRM,
	ST_CONFIRMED_VERSION,
	ST_DEAD_VERSION,
	ST_DEAD_INSERT,
	ST_SPOOL_EACH,
	ST_SPOOL_STATS,
	ST_SPOOL_BYTES,
	ST_DEAD_LIST,
	ST_DEAD_LAST,
	ST_DEAD_BOUND,
	ST_DEAD_TO_SPOOL,
	ST_DEAD_CLEAR,
	ST_PURGE_SEGMENTS,
	ST_PURGE_CONFIRMED,
	ST_PURGE_CONVERSATIONS,
	ST_REPAIR_PUT,
	ST_REPAIR_DELETE,
	ST_REPAIR_EACH,
	ST_COUNT,
};

/* The spool has no index by conversation: NOT IN reads it once. */
#define PURGEABLE "closed != 0 AND closed < ?1 AND id NOT IN (SELECT conversation FROM spool)"

static const char *const stmt_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_BATCH_PUT] = "INSERT INTO batches(seq, data) VALUES(?1, ?2)",
    [ST_BATCH_PUT1] = "INSERT INTO batches1(seq, data) VALUES(?1, ?2)",
    /* No WHERE: SQLite's truncate. */
    [ST_BATCH_CLEAR] = "DELETE FROM batches",
    [ST_BATCH_CLEAR1] = "DELETE FROM batches1",
    [ST_BATCH_EACH] = "SELECT seq, data, 0 FROM batches UNION ALL"
                      " SELECT seq, data, 1 FROM batches1 ORDER BY seq",
    [ST_SEGMENT_PUT] = "INSERT INTO segments(conversation, data) VALUES(?1, ?2)",
    [ST_SEGMENTS_OF] = "SELECT data FROM segments WHERE conversation = ?1 ORDER BY seq",
    [ST_SEGMENTS_NEWEST] = "SELECT data FROM segments WHERE conversation = ?1 ORDER BY seq DESC",
    [ST_CONVERSATION_GET] = "SELECT updated FROM conversations WHERE id = ?1",
    [ST_PUT_CONVERSATION] = "INSERT INTO conversations(id, updated, closed) VALUES(?1, ?2, 0)"
                            " ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, closed = 0",
    [ST_SET_CLOSED] = "UPDATE conversations SET closed = ?2 WHERE id = ?1",
    [ST_OPEN_EACH] = "SELECT id FROM conversations WHERE closed = 0 ORDER BY id",
    /* map_bytes follows the version it belongs to. */
    [ST_SPOOL_PUT] = "INSERT INTO spool(conversation, sk, version, enqueued, map_bytes)"
                     " VALUES(?1, ?2, ?3, ?4, ?5) ON CONFLICT(sk, conversation) DO UPDATE"
                     " SET version = max(version, excluded.version), map_bytes = CASE WHEN"
                     " excluded.version >= version THEN excluded.map_bytes ELSE map_bytes END",
    [ST_SPOOL_DELETE] = "DELETE FROM spool WHERE conversation = ?1 AND sk = ?2 AND version <= ?3",
    [ST_SPOOL_VERSION] = "SELECT version FROM spool WHERE sk = ?2 AND conversation = ?1",
    [ST_CONFIRM] = "INSERT INTO confirmed(conversation, sk, version) VALUES(?1, ?2, ?3)"
                   " ON CONFLICT(conversation, sk) DO UPDATE"
                   " SET version = max(version, excluded.version)",
    [ST_CONFIRMED_VERSION] = "SELECT version FROM confirmed WHERE conversation = ?1 AND sk = ?2",
    [ST_DEAD_VERSION] = "SELECT max(version) FROM dead_letters WHERE conversation = ?1 AND sk = ?2",
    [ST_DEAD_INSERT] = "INSERT INTO dead_letters(conversation, sk, version, item, error, at)"
                       " VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
    [ST_SPOOL_EACH] = "SELECT seq, conversation, sk, version, enqueued FROM spool"
                      " WHERE seq > ?1 ORDER BY seq",
    [ST_SPOOL_STATS] = "SELECT count(*), coalesce(sum(map_bytes), 0),"
                       " coalesce(min(enqueued), 0) FROM spool",
    [ST_SPOOL_BYTES] = "SELECT count(*), coalesce(sum(map_bytes), 0), coalesce(max(seq), ?1)"
                       " FROM (SELECT seq, map_bytes FROM spool WHERE seq > ?1"
                       " ORDER BY seq LIMIT ?2)",
    [ST_DEAD_LIST] = "SELECT conversation, sk, version, error, at FROM"
                     " (SELECT * FROM dead_letters ORDER BY seq DESC LIMIT ?1) ORDER BY seq",
    [ST_DEAD_LAST] = "SELECT coalesce(max(seq), 0) FROM dead_letters",
    /* The seq a part of a retry ends at, and whether a row is left after it. */
    [ST_DEAD_BOUND] = "SELECT seq FROM dead_letters WHERE seq <= ?1 ORDER BY seq LIMIT 2 OFFSET ?2",
    /* The WHERE also keeps SQLite's parser from reading ON CONFLICT as a join's. NOT
     * INDEXED: to group by message, SQLite would read dead_letters_by_message whole,
     * which for a part of a large table costs the whole table each time. */
    [ST_DEAD_TO_SPOOL] =
        "INSERT INTO spool(conversation, sk, version, enqueued)"
        " SELECT conversation, sk, max(version), ?1 FROM dead_letters NOT INDEXED"
        " WHERE seq <= ?2"
        " GROUP BY conversation, sk ORDER BY min(seq)"
        " ON CONFLICT(sk, conversation) DO UPDATE SET version = max(version, excluded.version)",
    [ST_DEAD_CLEAR] = "DELETE FROM dead_letters WHERE seq <= ?1",
    [ST_PURGE_SEGMENTS] = "DELETE FROM segments WHERE conversation IN"
                          " (SELECT id FROM conversations WHERE " PURGEABLE ")",
    [ST_PURGE_CONFIRMED] = "DELETE FROM confirmed WHERE conversation IN"
                           " (SELECT id FROM conversations WHERE " PURGEABLE ")",
    [ST_PURGE_CONVERSATIONS] = "DELETE FROM conversations WHERE " PURGEABLE,
    [ST_REPAIR_PUT] = "INSERT OR REPLACE INTO repairs(conversation, sk, version, due)"
                      " VALUES(?1, ?2, ?3, ?4)",
    [ST_REPAIR_DELETE] = "DELETE FROM repairs WHERE conversation = ?1 AND sk = ?2 AND version = ?3",
    [ST_REPAIR_EACH] = "SELECT conversation, sk, version, due FROM repairs ORDER BY due",
};

/* Checkpoints run on a thread of their own with a second connection, so that copying the
 * WAL back and its fsync never stall the loop's commits. A WAL checkpoint by another
 * connection is ordinary SQLite concurrency: PASSIVE mode never blocks the writer, and the
 * writer starts the WAL over once a checkpoint has copied all of it. */
struct checkpointer {
	pthread_t thread;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool started, stop, wanted;
	bool held;         /* store_hold_checkpoints */
	bool running;      /* a checkpoint runs: the thread's, or the writer's own */
	int last_rc;       /* SQLite code of the last checkpoint */
	int reported_rc;   /* what wal_hook last logged */
	uint64_t runs;     /* checkpoints done: the thread's rounds, catch-ups, bound waits */
	uint64_t catch_ups;   /* of them, checkpoint_catch_up's */
	uint64_t bound_waits; /* and checkpoint_after_round's (the WAL at its hard bound) */
	uint64_t ns;          /* time in them */
	const char *path;  /* the store's */
	enum durability durability;
	/* The thread's last round left little behind: the next commit copies it, so that the
	 * WAL starts over (checkpoint_catch_up). */
	_Atomic bool catch_up;
	_Atomic int wal_frames;     /* the WAL's size at the last commit (wal_hook) */
	_Atomic int catch_up_pages; /* STORE_CATCH_UP_PAGES, or what a test set */
	/* The WAL's writeback, asked by wal_hook (durability process): wanted, how often it was
	 * started, and the thread's own descriptor of the WAL file (-1 until it exists). */
	bool writeback_wanted;
	uint64_t writebacks;
	int wal_fd;
};

/* One pending record, and the next record of its conversation (SIZE_MAX: none). */
struct pentry {
	const char *rec;
	size_t next;
};

/* The pending records of one conversation: a chain of entries in commit order. */
struct pconv {
	const char *id; /* borrowed from its first record */
	size_t id_len;
	uint64_t hash;
	size_t first, last, n;
};

/* Committed batches not yet folded: their records, chained per conversation, and a table
 * of the conversations (open addressing on a keyed hash: ids come from clients). */
struct pending {
	char **batches; /* owned record strings */
	size_t nbatches, capbatches;
	struct pentry *entries;
	size_t nentries, capentries;
	struct pconv *convs;
	size_t nconvs, capconvs;
	uint32_t *slots; /* index + 1 into convs, 0 = empty; a power of two, at most half full */
	size_t nslots;
	uint64_t last_seq; /* of the newest batch here */
};

/* What one of the two tables of batches holds: nothing, the batches of the next fold cycle
 * (pending next), of the cycle under way (cur), or of one that ended (dead: to empty). */
enum bt_state { BT_EMPTY, BT_NEXT, BT_CUR, BT_DEAD };

struct batch_table {
	enum bt_state state;
	uint64_t rows;
};

/* The counters of store_stats: written by whichever thread writes, read by the loop. */
struct store_counters {
	_Atomic uint64_t commits, turns, inline_commits, records, commit_ns, commit_max_ns, pending,
	    fold_cycles, fold_segments, fold_records, fold_ns, dead_batches, wal_pages,
	    cohort_waits, cohort_short, cohort_ns;
};

struct store {
	sqlite3 *db;
	struct store_counters n;
	struct walvfs_counts syncs_at_open; /* the VFS's (whole process) when the store opened */
	struct checkpointer ck;
	char *path; /* DIR/convod.db, for messages */
	/* path with the links of its last name followed: SQLite names the WAL and -shm after
	 * the file a link leads to, and puts them beside it (links_followed). */
	char *real;
	sqlite3_stmt *st[ST_COUNT];
	/* The loop's side: the open transaction. */
	bool in_txn;
	int txn_err;      /* first failed write of the open transaction, 0 if none */
	size_t txn_repairs; /* rows of repairs it puts (store_repairs_in_transaction) */
	struct buf packed; /* packed map of the last store_put_message, reused */
	struct buf batch; /* message records of the open transaction */
	size_t batch_records;
	struct buf ops;   /* its other writes (op_record) */
	/* The writer thread and its queue (see "the writer thread"). */
	pthread_t writer;
	bool writer_started, locks_ready;
	pthread_mutex_t qmu; /* the queue and the progress below */
	pthread_cond_t qcv;
	struct job *queue, *queue_tail;
	_Atomic bool jobs_waiting; /* the queue is not empty: the fold's idle step ends early */
	bool stop;
	size_t queued_records; /* message records of the queued jobs */
	/* The last commit the writer wrote: its records, the records queued when it ended,
	 * and when (cohort_wait); whether the wait after it fell short. */
	size_t cohort_records, cohort_queued;
	uint64_t cohort_end_ns, cohort_wait_ns; /* the latter STORE_COHORT_WAIT_NS but in tests */
	bool cohort_missed;
	uint64_t submitted;    /* seq of the last job queued */
	uint64_t committed;    /* the highest seq written, in order */
	bool failed;           /* a write failed, not yet acknowledged by store_failure_ack */
	bool busy;             /* a job is being written (by the writer or inline) */
	bool wal_full;         /* a commit of the loop's took the WAL past its bound */
	bool idle_wanted;      /* store_idle: fold everything, then give memory back */
	size_t fold_records;   /* STORE_FOLD_RECORDS, or what a test set */
	bool no_idle_fold;     /* a test turned the writer's fold between jobs off (qmu) */
	int checkpoint_pages;  /* STORE_CHECKPOINT_PAGES, or what a test set */
	int wal_hard_pages;    /* STORE_WAL_HARD_PAGES, or what a test set */
	uint64_t wal_commits_dropped; /* wal_check's, at open */
	int writeback_pages;   /* STORE_WAL_WRITEBACK_PAGES, or what a test set (0: never) */
	int writeback_at;      /* the WAL's size when wal_hook last asked for its writeback */
	enum durability durability;
	int fail_error;
	uint64_t void_through; /* jobs up to this seq were queued before an acknowledged failure */
	void (*wake)(void *arg);
	void *wake_arg;
	pthread_mutex_t dbmu; /* the connection and the pending records: writer or reader */
	/* The writer's side: the fold. */
	struct pending next; /* committed, not in a fold cycle yet */
	struct pending cur;  /* the fold cycle's: sorted by conversation */
	size_t cursor;       /* cur's next entry to fold */
	size_t txn_cursor;   /* cursor when the open transaction began */
	bool txn_fold_started, txn_fold_ended; /* what the transaction's fold step did */
	bool sync_lost; /* machine: synchronous=FULL not set back after a fold (tx_begin) */
	bool fail_sync_full;                   /* a test's: setting it back fails (dbmu) */
	unsigned sync_full_failures;           /* and how often it did */
	size_t txn_segments, txn_folded;       /* and how much it wrote */
	/* The two tables of batches: whose batches each holds, and how many (the open
	 * transaction's included); at the start of that transaction, txn_bt. */
	struct batch_table bt[2], txn_bt[2];
	bool sink_rows; /* spool, confirmed or dead-letter rows may exist: loads look them up */
	bool dead_rows; /* dead-letter rows may exist: loads look them up too */
	uint64_t hash_key[2];
};

static const char *const durability_names[] = {"none", "process", "machine"};

int store_durability_parse(const char *s, enum durability *out)
{
	for (int i = DURABILITY_NONE; i <= DURABILITY_MACHINE; i++) {
		if (s && strcmp(s, durability_names[i]) == 0) {
			*out = (enum durability)i;
			return 0;
		}
	}
	return -EINVAL;
}

const char *store_durability_str(enum durability d)
{
	return d <= DURABILITY_MACHINE ? durability_names[d] : "unknown";
}

static void count_add(_Atomic uint64_t *c, uint64_t v)
{
	atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static void count_set(_Atomic uint64_t *c, uint64_t v)
{
	atomic_store_explicit(c, v, memory_order_relaxed);
}

static uint64_t count_get(_Atomic uint64_t *c)
{
	return atomic_load_explicit(c, memory_order_relaxed);
}

static void set_errbuf(char *errbuf, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_errbuf(char *errbuf, size_t errlen, const char *fmt, ...)
{
	va_list ap;
	if (!errbuf || !errlen)
		return;
	va_start(ap, fmt);
	vsnprintf(errbuf, errlen, fmt, ap);
	va_end(ap);
}

/* -errno for a failed SQLite call: a full disk (or the size cap) is -ENOSPC, anything
 * else -EIO. */
static int errno_of(sqlite3 *db, int rc)
{
	if ((rc & 0xff) == SQLITE_FULL)
		return -ENOSPC;
	if ((rc & 0xff) == SQLITE_IOERR && sqlite3_system_errno(db) == ENOSPC)
		return -ENOSPC;
	return -EIO;
}

/* Logs a failed statement and returns its -errno. */
static int fail(struct store *s, sqlite3_stmt *st, int rc)
{
	log_msg(LOG_ERROR, "store", "%s: %s (in \"%.40s...\")", s->path, sqlite3_errmsg(s->db),
	        st ? sqlite3_sql(st) : "");
	return errno_of(s->db, rc);
}

/* Runs a statement that returns no rows and resets it. 0 or -errno (logged). */
static int run(struct store *s, sqlite3_stmt *st)
{
	int rc = sqlite3_step(st);
	int err = rc == SQLITE_DONE ? 0 : fail(s, st, rc);
	sqlite3_reset(st);
	return err;
}

/* Start of every write that needs the caller's transaction. */
static int write_check(struct store *s)
{
	if (!s->in_txn)
		return -EINVAL;
	return s->txn_err;
}

/* End of every write: remembers the first failure of the transaction. */
static int write_done(struct store *s, int rc)
{
	if (rc && rc != -EINVAL && s->in_txn && !s->txn_err)
		s->txn_err = rc;
	return rc;
}

static int bind_conv(sqlite3_stmt *st, int i, const char *conv, size_t conv_len)
{
	/* A zero-length blob needs a non-NULL pointer, or it binds NULL. */
	return sqlite3_bind_blob64(st, i, conv_len ? conv : "", conv_len, SQLITE_STATIC);
}


/* Reads one integer (or the first row's first column as text into text) of a statement. */
static int query_one(sqlite3 *db, const char *sql, int64_t *num, char *text, size_t text_len)
{
	sqlite3_stmt *st = NULL;
	int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
	if (rc != SQLITE_OK)
		return rc;
	rc = sqlite3_step(st);
	if (rc == SQLITE_ROW) {
		if (num)
			*num = sqlite3_column_int64(st, 0);
		if (text) {
			const unsigned char *t = sqlite3_column_text(st, 0);
			snprintf(text, text_len, "%s", t ? (const char *)t : "");
		}
		rc = SQLITE_OK;
	} else if (rc == SQLITE_DONE) {
		rc = SQLITE_EMPTY;
	}
	sqlite3_finalize(st);
	return rc;
}

/* The first row of PRAGMA quick_check: "ok" for a sound file, else the first problem. Rows
 * spanning several lines are joined. */
static int quick_check(sqlite3 *db, char *out, size_t out_len)
{
	int rc;
	out[0] = 0;
	rc = query_one(db, "PRAGMA quick_check(1)", NULL, out, out_len);
	for (char *p = out; *p; p++) {
		if (*p == '\n')
			*p = ' ';
	}
	return rc;
}


/* Builds one segment per conversation from the rows of a schema 1 or 2 messages table. */
static int upgrade_messages(sqlite3 *db)
{
	sqlite3_stmt *rd = NULL, *wr = NULL;
	struct buf seg = {NULL, 0, 0}, conv = {NULL, 0, 0};
	int rc, step;

	rc = sqlite3_prepare_v2(db,
	                        "SELECT conversation, sk, version, updated, client_seen, map"
	                        " FROM messages ORDER BY conversation, sk",
	                        -1, &rd, NULL);
	if (rc == SQLITE_OK)
		rc = sqlite3_prepare_v2(db, stmt_sql[ST_SEGMENT_PUT], -1, &wr, NULL);
	while (rc == SQLITE_OK && (step = sqlite3_step(rd)) == SQLITE_ROW) {
		const char *id = sqlite3_column_blob(rd, 0);
		size_t id_len = (size_t)sqlite3_column_bytes(rd, 0);
		struct msgrec r = {NULL, 0, NULL, 0, 0, 0, 0, NULL, 0, false}; /* JSON maps */

		if (seg.len && (id_len != conv.len || (id_len && memcmp(id, conv.data, id_len)))) {
			sqlite3_bind_blob64(wr, 1, conv.len ? conv.data : "", conv.len, SQLITE_STATIC);
			sqlite3_bind_blob64(wr, 2, seg.data, seg.len, SQLITE_STATIC);
			rc = sqlite3_step(wr) == SQLITE_DONE ? SQLITE_OK : sqlite3_errcode(db);
			sqlite3_reset(wr);
			seg.len = 0;
		}
		conv.len = 0;
		if (buf_append(&conv, id_len ? id : "", id_len) < 0) {
			rc = SQLITE_NOMEM;
			break;
		}
		r.sk = (const char *)sqlite3_column_text(rd, 1);
		r.sk_len = r.sk ? (size_t)sqlite3_column_bytes(rd, 1) : 0;
		r.version = (uint32_t)sqlite3_column_int64(rd, 2);
		r.updated_ms = sqlite3_column_int64(rd, 3);
		r.client_seen = (uint32_t)sqlite3_column_int64(rd, 4);
		r.map = (const char *)sqlite3_column_text(rd, 5);
		r.map_len = r.map ? (size_t)sqlite3_column_bytes(rd, 5) : 0;
		if (rc == SQLITE_OK && msgrec_append(&seg, &r) == -ENOMEM)
			rc = SQLITE_NOMEM;
		/* A row that cannot be a record is left out; loading would refuse it anyway. */
	}
	if (rc == SQLITE_OK && step != SQLITE_DONE)
		rc = sqlite3_errcode(db);
	if (rc == SQLITE_OK && seg.len) {
		sqlite3_bind_blob64(wr, 1, conv.len ? conv.data : "", conv.len, SQLITE_STATIC);
		sqlite3_bind_blob64(wr, 2, seg.data, seg.len, SQLITE_STATIC);
		rc = sqlite3_step(wr) == SQLITE_DONE ? SQLITE_OK : sqlite3_errcode(db);
	}
	sqlite3_finalize(rd);
	sqlite3_finalize(wr);
	buf_free(&seg);
	buf_free(&conv);
	return rc;
}

/* Schema 1 (a messages table) or 2 (messages and a journal) to 3, 3 to 4, 4 to 5 and 5 to
 * 6, in one transaction. 4 only adds the packed records, and reads those of 3; 5 only adds
 * the second table of batches; 6 only the index of the dead letters. */
static int upgrade(sqlite3 *db, int64_t from)
{
	char sql[64];
	int rc = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);

	if (rc == SQLITE_OK && from == 2)
		rc = sqlite3_exec(
		    db,
		    "INSERT INTO messages(conversation, sk, version, updated, client_seen, map_bytes,"
		    " map) SELECT conversation, sk, version, updated, client_seen, map_bytes, map"
		    " FROM (SELECT *, max(seq) FROM journal GROUP BY conversation, sk) WHERE true"
		    " ON CONFLICT(conversation, sk) DO UPDATE SET version = excluded.version,"
		    " updated = excluded.updated, client_seen = excluded.client_seen,"
		    " map_bytes = excluded.map_bytes, map = excluded.map;"
		    "DROP TABLE journal",
		    NULL, NULL, NULL);
	if (rc == SQLITE_OK && from < 3)
		rc = sqlite3_exec(db, schema3_sql, NULL, NULL, NULL);
	if (rc == SQLITE_OK && from < 3)
		rc = sqlite3_exec(
		    db,
		    "ALTER TABLE spool ADD COLUMN map_bytes INTEGER NOT NULL DEFAULT 0;"
		    "UPDATE spool SET map_bytes = coalesce((SELECT m.map_bytes FROM messages m"
		    " WHERE m.conversation = spool.conversation AND m.sk = spool.sk), 0);"
		    "INSERT INTO confirmed(conversation, sk, version)"
		    " SELECT conversation, sk, confirmed FROM messages WHERE confirmed > 0",
		    NULL, NULL, NULL);
	if (rc == SQLITE_OK && from < 3)
		rc = upgrade_messages(db);
	if (rc == SQLITE_OK && from < 5)
		rc = sqlite3_exec(db, schema5_sql, NULL, NULL, NULL);
	if (rc == SQLITE_OK)
		rc = sqlite3_exec(db, schema6_sql, NULL, NULL, NULL);
	if (rc == SQLITE_OK)
		rc = sqlite3_exec(db, schema7_sql, NULL, NULL, NULL);
	snprintf(sql, sizeof(sql), "%sPRAGMA user_version=%d; COMMIT",
	         from < 3 ? "DROP TABLE messages; " : "", STORE_SCHEMA_VERSION);
	if (rc == SQLITE_OK)
		rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
	return rc;
}

/* The checks and settings of store_open on an opened connection. */
static int open_checks(struct store *s, enum durability durability, char *errbuf, size_t errlen)
{
	sqlite3 *db = s->db;
	int64_t app_id = 0, version = 0, tables = 0;
	char text[256];
	int rc;

	if (sqlite3_db_readonly(db, "main") == 1) {
		set_errbuf(errbuf, errlen, "%s is read-only", s->path);
		return -EACCES;
	}
	/* The first read of the file: a file that is not SQLite fails here. */
	if ((rc = query_one(db, "PRAGMA application_id", &app_id, NULL, 0)) != SQLITE_OK ||
	    (rc = query_one(db, "PRAGMA user_version", &version, NULL, 0)) != SQLITE_OK)
		goto not_ours;
	if ((rc = quick_check(db, text, sizeof(text))) != SQLITE_OK)
		goto not_ours;
	if (strcmp(text, "ok") != 0) {
		set_errbuf(errbuf, errlen, "%s is not a convod database: it is corrupt (%s)",
		           s->path, text);
		return -EIO;
	}
	if (app_id != 0 && app_id != STORE_APPLICATION_ID) {
		set_errbuf(errbuf, errlen,
		           "%s is not a convod database: it belongs to another application "
		           "(application_id %" PRId64 ")",
		           s->path, app_id);
		return -EIO;
	}
	if (version > STORE_SCHEMA_VERSION) {
		set_errbuf(errbuf, errlen,
		           "%s was written by a newer convod (schema %" PRId64
		           ", this one knows up to %d)",
		           s->path, version, STORE_SCHEMA_VERSION);
		return -EIO;
	}
	if ((rc = query_one(db, "PRAGMA journal_mode=WAL", NULL, text, sizeof(text))) != SQLITE_OK)
		goto not_ours;
	if (strcmp(text, "wal") != 0) {
		set_errbuf(errbuf, errlen, "%s: cannot use a WAL journal (journal mode is %s)",
		           s->path, text);
		return -EIO;
	}
	/* checkpoint_fullfsync: the syncs of checkpoints come with SQLITE_SYNC_FULL, which
	 * costs nothing on Linux (no F_FULLFSYNC), so that walvfs tells a commit's own sync
	 * from them (WALVFS_SYNCED_NAME). */
	rc = sqlite3_exec(db,
	                  durability == DURABILITY_MACHINE
	                      ? "PRAGMA synchronous=FULL; PRAGMA checkpoint_fullfsync=ON"
	                      : "PRAGMA synchronous=NORMAL",
	                  NULL, NULL, NULL);
	if (rc != SQLITE_OK)
		goto not_ours;
	/* Debian builds SQLite with secure_delete on: every deleted row, and every page a
	 * delete frees, is overwritten with zeros, so each folded batch was written to the WAL
	 * a second time as zeros (0.18 -> 0.12 WAL pages per record folded; 357k -> 395k
	 * req/s at a pipeline of 16, 126k -> 146k without). FAST still zeros deleted rows in
	 * their b-tree pages, but not pages going to the free list (convod(8) says so). */
	if ((rc = sqlite3_exec(db, "PRAGMA secure_delete=FAST", NULL, NULL, NULL)) != SQLITE_OK)
		goto not_ours;
	/* SQLite's default page size (4096) stays. 2048 writes fewer bytes a commit (a turn's
	 * batch is about 2.5 kB), but 12 ABBA pairs at 50 connections, process, had the loop's
	 * CPU a request higher in 8 (8.56 -> 9.01 us) and req/s lower in 8; at machine, 8
	 * pairs, req/s and p99 equal (4 of 8 either way). */
	if (version == 0) {
		if ((rc = query_one(db, "SELECT count(*) FROM sqlite_schema", &tables, NULL, 0)) !=
		    SQLITE_OK)
			goto not_ours;
		if (tables) {
			set_errbuf(errbuf, errlen,
			           "%s is not a convod database: it holds other tables", s->path);
			return -EIO;
		}
		rc = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, schema_sql, NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, schema3_sql, NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, schema5_sql, NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, schema6_sql, NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, schema7_sql, NULL, NULL, NULL);
		if (rc == SQLITE_OK) {
			char sql[128];
			snprintf(sql, sizeof(sql),
			         "PRAGMA application_id=%d; PRAGMA user_version=%d; COMMIT",
			         STORE_APPLICATION_ID, STORE_SCHEMA_VERSION);
			rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
		}
		if (rc != SQLITE_OK) {
			int err = errno_of(db, rc);
			set_errbuf(errbuf, errlen, "%s: cannot create the tables: %s", s->path,
			           sqlite3_errmsg(db));
			if (!sqlite3_get_autocommit(db))
				sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
			return err;
		}
	} else if (version < STORE_SCHEMA_VERSION) {
		rc = upgrade(db, version);
		if (rc != SQLITE_OK) {
			int err = errno_of(db, rc);
			set_errbuf(errbuf, errlen, "%s: cannot upgrade the schema from %" PRId64 ": %s",
			           s->path, version, sqlite3_errmsg(db));
			if (!sqlite3_get_autocommit(db))
				sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
			return err;
		}
		log_msg(LOG_INFO, "store", "%s: upgraded from schema %" PRId64 " to %d", s->path,
		        version, STORE_SCHEMA_VERSION);
	}
	for (int i = 0; i < ST_COUNT; i++) {
		rc = sqlite3_prepare_v3(db, stmt_sql[i], -1, SQLITE_PREPARE_PERSISTENT, &s->st[i],
		                        NULL);
		if (rc != SQLITE_OK)
			goto not_ours;
	}
	return 0;

not_ours:
	if ((rc & 0xff) == SQLITE_NOTADB || (rc & 0xff) == SQLITE_CORRUPT ||
	    (rc & 0xff) == SQLITE_ERROR) {
		set_errbuf(errbuf, errlen, "%s is not a convod database: %s", s->path,
		           sqlite3_errmsg(db));
		return -EIO;
	}
	set_errbuf(errbuf, errlen, "%s: %s", s->path, sqlite3_errmsg(db));
	return errno_of(db, rc);
}

/* Syncs db's database file. SQLite syncs it only after a checkpoint that reached the WAL's
 * end, which under continuous writes none of the thread's do: the pages they copied stayed
 * dirty in the kernel, and the one checkpoint that did reach the end, with commits held,
 * waited 20-100 ms for all of them to be written. Writing the file back first in 4 MB
 * steps, each waited for (sync_file_range), so that the writer's syncs at machine never
 * queue behind more than 4 MB: 12 paired runs at machine, p99 higher in 10 (means 1.75 ->
 * 2.06 ms), req/s unchanged (119k); not taken. */
static int sync_database(sqlite3 *db)
{
	sqlite3_file *f = NULL;
	int rc = sqlite3_file_control(db, "main", SQLITE_FCNTL_FILE_POINTER, &f);

	if (rc != SQLITE_OK || !f || !f->pMethods)
		return rc;
	return f->pMethods->xSync(f, SQLITE_SYNC_NORMAL);
}

enum checkpoint_kind { CHECKPOINT_ROUND, CHECKPOINT_CATCH_UP, CHECKPOINT_BOUND };

/* A checkpoint of kind took ns and returned rc: counted, and whoever waits for the
 * checkpointer to be free is woken (ck->mu held). */
static void checkpoint_ended(struct checkpointer *ck, enum checkpoint_kind kind, uint64_t ns,
                             int rc)
{
	ck->running = false;
	ck->runs++;
	ck->catch_ups += kind == CHECKPOINT_CATCH_UP;
	ck->bound_waits += kind == CHECKPOINT_BOUND;
	ck->ns += ns;
	/* SQLITE_BUSY from a round or a catch-up: the WAL was being started over at that
	 * moment; the next one copies what this one could not. Not a failure to report. At the
	 * bound, with no commit in between, it is one. */
	if (rc != SQLITE_BUSY || kind == CHECKPOINT_BOUND)
		ck->last_rc = rc;
	pthread_cond_broadcast(&ck->cv); /* a writer waiting to checkpoint itself */
}

/* Starts the writeback of the WAL file's dirty pages, without waiting for it, so that the
 * syncs that must (a checkpoint's, the commit that starts the WAL over) find little left to
 * write. On the checkpoint thread: the call may block while the disk's queue is full. The
 * descriptor is the thread's own; closing it cannot drop SQLite's locks, which lie in the
 * database and -shm files, never in the WAL. Returns whether it was started. */
static bool wal_writeback(struct checkpointer *ck)
{
	if (ck->wal_fd < 0) {
		char name[4096];
		if (snprintf(name, sizeof(name), "%s-wal", ck->path) >= (int)sizeof(name))
			return false;
		if ((ck->wal_fd = open(name, O_RDONLY | O_CLOEXEC)) < 0)
			return false;
	}
	return sync_file_range(ck->wal_fd, 0, 0, SYNC_FILE_RANGE_WRITE) == 0;
}

/* Names a thread the store started (top -H, perf, /proc/PID/task/TID/comm). It is done
 * here, by the thread that started it, so that the name is in place before the daemon
 * listens: named by the thread itself, it showed the process's name until that thread
 * first ran, which under valgrind could be after a client's first answer. A name that
 * cannot be set is only cosmetic. */
static void thread_name(pthread_t t, const char *name)
{
	(void)pthread_setname_np(t, name);
}

static void *checkpointer_main(void *arg)
{
	struct checkpointer *ck = arg;
	sqlite3 *db = NULL;

	/* Named by the thread that starts it (thread_name, at most 15 characters).
	 * Its policy stays the default. At SCHED_IDLE its rounds no longer took turns with the
	 * load generator for the other CPU (perf sched: generator waits over 0.3 ms 50 -> 7 in
	 * 2 s), and p99 at 50 connections was lower in 12 of 16 paired runs (means of the
	 * last 12, 1.03 -> 0.96 ms); but the thread then runs only on a CPU nothing else
	 * wants, cannot raise its priority again, and holds SQLite's shared-memory locks
	 * while it copies: on a host whose CPUs are busy (speech models beside convod) the
	 * loop's commits would wait for it, and its rounds starve. Pausing it instead (a
	 * yield every 4 pages it copies, or a sleep every 8 or 32: a VFS hook) cut the
	 * generator's waits less (50 -> 15-40) and left p99 where it was (single runs). */
	pthread_mutex_lock(&ck->mu);
	for (;;) {
		while ((!ck->wanted || ck->running || ck->held) && !ck->writeback_wanted &&
		       !ck->stop)
			pthread_cond_wait(&ck->cv, &ck->mu);
		if (ck->stop)
			break;
		if (ck->writeback_wanted) {
			ck->writeback_wanted = false;
			pthread_mutex_unlock(&ck->mu);
			bool started = wal_writeback(ck);
			pthread_mutex_lock(&ck->mu);
			ck->writebacks += started;
			continue;
		}
		ck->wanted = false;
		ck->running = true;
		pthread_mutex_unlock(&ck->mu);
		int rc = SQLITE_OK;
		if (!db) {
			/* Through walvfs too, which writes nothing of its own here but counts
			 * the round's syncs (store_stats). */
			rc = sqlite3_open_v2(ck->path, &db,
			                     SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX |
			                         SQLITE_OPEN_EXRESCODE,
			                     WALVFS_NAME);
			if (rc == SQLITE_OK) {
				sqlite3_busy_timeout(db, STORE_BUSY_TIMEOUT_MS);
				/* The checkpoint syncs the database file as the writer's level
				 * asks; at none it does not sync at all. */
				rc = sqlite3_exec(db,
				                  ck->durability == DURABILITY_NONE
				                      ? "PRAGMA synchronous=OFF"
				                      : "PRAGMA synchronous=NORMAL",
				                  NULL, NULL, NULL);
			}
			if (rc != SQLITE_OK) {
				sqlite3_close(db);
				db = NULL;
			}
		}
		uint64_t t0 = mono_ns();
		int copied = 0;
		if (db)
			rc = sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL,
			                               &copied);
		if (rc == SQLITE_OK && ck->durability != DURABILITY_NONE)
			rc = sync_database(db);
		t0 = mono_ns() - t0;
		pthread_mutex_lock(&ck->mu);
		if (rc == SQLITE_OK &&
		    atomic_load_explicit(&ck->wal_frames, memory_order_relaxed) - copied <=
		        atomic_load_explicit(&ck->catch_up_pages, memory_order_relaxed)) {
			/* The asks of the commits made during the round are answered too. */
			atomic_store_explicit(&ck->catch_up, true, memory_order_relaxed);
			ck->wanted = false;
		}
		checkpoint_ended(ck, CHECKPOINT_ROUND, t0, rc);
	}
	pthread_mutex_unlock(&ck->mu);
	sqlite3_close(db);
	if (ck->wal_fd >= 0)
		close(ck->wal_fd);
	ck->wal_fd = -1;
	return NULL;
}

/* Asks the checkpoint thread for a round; returns the SQLite code of the last one. */
static int checkpoint_ask(struct checkpointer *ck)
{
	int rc;

	pthread_mutex_lock(&ck->mu);
	ck->wanted = true;
	pthread_cond_signal(&ck->cv);
	rc = ck->last_rc;
	pthread_mutex_unlock(&ck->mu);
	return rc;
}

/* After a commit on db, the writing connection (held): when the thread's last round left
 * little behind, copies the frames of the commits made during it, with no commit in
 * between, so that the next commit starts the WAL over. Without it, under continuous
 * writes no round ever reached the WAL's end, rounds ran back to back (about 140 a second
 * at 50 connections), and the WAL grew to STORE_WAL_HARD_PAGES, where the writer held
 * commits for a whole checkpoint. Skipped while a round runs. */
static void checkpoint_catch_up(struct checkpointer *ck, sqlite3 *db)
{
	uint64_t t0;
	int rc;

	if (!atomic_load_explicit(&ck->catch_up, memory_order_relaxed))
		return;
	pthread_mutex_lock(&ck->mu);
	if (ck->running) {
		pthread_mutex_unlock(&ck->mu);
		return;
	}
	atomic_store_explicit(&ck->catch_up, false, memory_order_relaxed);
	ck->running = true;
	pthread_mutex_unlock(&ck->mu);
	t0 = mono_ns();
	rc = sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
	t0 = mono_ns() - t0;
	pthread_mutex_lock(&ck->mu);
	checkpoint_ended(ck, CHECKPOINT_CATCH_UP, t0, rc);
	pthread_mutex_unlock(&ck->mu);
}

/* Waits for the checkpoint thread's round to end, then checkpoints on db, the writing
 * connection, holding conn_lock (when not NULL) meanwhile: with no other writer and no
 * other checkpointer it copies all the thread has not, and the next commit starts the WAL
 * over. The thread's round runs with commits going on; what is left after it is short.
 * Returns SQLite's code. */
static int checkpoint_after_round(struct checkpointer *ck, sqlite3 *db, const char *name,
                                  pthread_mutex_t *conn_lock)
{
	uint64_t t0;
	int rc;

	pthread_mutex_lock(&ck->mu);
	while (ck->running)
		pthread_cond_wait(&ck->cv, &ck->mu);
	ck->running = true;
	pthread_mutex_unlock(&ck->mu);
	if (conn_lock)
		pthread_mutex_lock(conn_lock);
	t0 = mono_ns();
	rc = sqlite3_wal_checkpoint_v2(db, name, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
	t0 = mono_ns() - t0;
	if (conn_lock)
		pthread_mutex_unlock(conn_lock);
	pthread_mutex_lock(&ck->mu);
	checkpoint_ended(ck, CHECKPOINT_BOUND, t0, rc);
	pthread_mutex_unlock(&ck->mu);
	return rc;
}

/* SQLite calls this after every commit with the WAL's size in pages (it replaces the
 * automatic checkpoint, which is thereby off). */
static int wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
	struct store *s = arg;
	struct checkpointer *ck = &s->ck;
	int rc;

	count_set(&s->n.wal_pages, (uint64_t)(pages > 0 ? pages : 0));
	atomic_store_explicit(&ck->wal_frames, pages, memory_order_relaxed);
	/* At durability process nothing writes the WAL's pages out before a sync needs them
	 * (machine syncs every commit; at none nothing waits for a sync): have the thread
	 * start it, every writeback_pages pages. */
	if (s->durability == DURABILITY_PROCESS && s->writeback_pages > 0) {
		if (pages < s->writeback_at)
			s->writeback_at = 0; /* the WAL started over */
		if (pages - s->writeback_at >= s->writeback_pages) {
			s->writeback_at = pages;
			pthread_mutex_lock(&ck->mu);
			ck->writeback_wanted = true;
			pthread_cond_signal(&ck->cv);
			pthread_mutex_unlock(&ck->mu);
		}
	}
	if (pages < s->checkpoint_pages)
		return SQLITE_OK;
	if (pages >= s->wal_hard_pages && s->writer_started &&
	    !pthread_equal(pthread_self(), s->writer)) {
		/* The loop wrote this commit itself: the wait below is the writer thread's to
		 * take (the loop meanwhile hands its commits over instead of blocking). */
		pthread_mutex_lock(&s->qmu);
		s->wal_full = true;
		pthread_cond_signal(&s->qcv);
		pthread_mutex_unlock(&s->qmu);
		return SQLITE_OK;
	}
	/* The thread's last round left little behind: this commit's writer copies it right
	 * after it (checkpoint_catch_up); a new round now would only keep it from doing so. */
	if (pages < s->wal_hard_pages && atomic_load_explicit(&ck->catch_up, memory_order_relaxed))
		return SQLITE_OK;
	/* The thread fell behind: the writer (or the thread opening or closing the store)
	 * takes the rest itself. */
	rc = pages >= s->wal_hard_pages ? checkpoint_after_round(ck, db, name, NULL)
	                                : checkpoint_ask(ck);
	if (rc != ck->reported_rc) {
		if (rc == SQLITE_OK)
			log_msg(LOG_INFO, "store", "%s: checkpoints work again", s->path);
		else
			log_msg(LOG_WARN, "store", "%s: checkpoint failed: %s; the WAL grows until "
			        "one succeeds", s->path, sqlite3_errstr(rc));
		ck->reported_rc = rc;
	}
	return SQLITE_OK;
}

static int checkpointer_start(struct store *s, enum durability durability)
{
	struct checkpointer *ck = &s->ck;
	int rc;

	ck->path = s->real; /* for its WAL's name (wal_writeback) */
	ck->durability = durability;
	ck->wal_fd = -1;
	if ((rc = pthread_mutex_init(&ck->mu, NULL)) != 0)
		return -rc;
	if ((rc = pthread_cond_init(&ck->cv, NULL)) != 0) {
		pthread_mutex_destroy(&ck->mu);
		return -rc;
	}
	if ((rc = pthread_create(&ck->thread, NULL, checkpointer_main, ck)) != 0) {
		pthread_cond_destroy(&ck->cv);
		pthread_mutex_destroy(&ck->mu);
		return -rc;
	}
	ck->started = true;
	thread_name(ck->thread, "convod-ckpt");
	sqlite3_wal_hook(s->db, wal_hook, s);
	return 0;
}

static void checkpointer_stop(struct store *s)
{
	struct checkpointer *ck = &s->ck;

	if (!ck->started)
		return;
	sqlite3_wal_hook(s->db, NULL, NULL);
	pthread_mutex_lock(&ck->mu);
	ck->stop = true;
	pthread_cond_signal(&ck->cv);
	pthread_mutex_unlock(&ck->mu);
	pthread_join(ck->thread, NULL);
	pthread_cond_destroy(&ck->cv);
	pthread_mutex_destroy(&ck->mu);
	ck->started = false;
}

static uint64_t file_bytes(const char *path, const char *suffix)
{
	char name[4096];
	struct stat st;

	if (snprintf(name, sizeof(name), "%s%s", path, suffix) >= (int)sizeof(name) ||
	    stat(name, &st) < 0)
		return 0;
	return (uint64_t)st.st_size;
}

void store_stats(struct store *s, struct store_stats *o)
{
	memset(o, 0, sizeof(*o));
	o->commits = count_get(&s->n.commits);
	o->turns = count_get(&s->n.turns);
	o->inline_commits = count_get(&s->n.inline_commits);
	o->records = count_get(&s->n.records);
	o->commit_ns = count_get(&s->n.commit_ns);
	o->commit_max_ns = count_get(&s->n.commit_max_ns);
	o->pending = count_get(&s->n.pending);
	o->fold_cycles = count_get(&s->n.fold_cycles);
	o->fold_segments = count_get(&s->n.fold_segments);
	o->fold_records = count_get(&s->n.fold_records);
	o->fold_ns = count_get(&s->n.fold_ns);
	o->dead_batches = count_get(&s->n.dead_batches);
	o->wal_pages = count_get(&s->n.wal_pages);
	o->cohort_waits = count_get(&s->n.cohort_waits);
	o->cohort_short = count_get(&s->n.cohort_short);
	o->cohort_ns = count_get(&s->n.cohort_ns);
	if (s->ck.started) {
		pthread_mutex_lock(&s->ck.mu);
		o->checkpoints = s->ck.runs;
		o->catch_ups = s->ck.catch_ups;
		o->bound_waits = s->ck.bound_waits;
		o->checkpoint_ns = s->ck.ns;
		o->wal_writebacks = s->ck.writebacks;
		pthread_mutex_unlock(&s->ck.mu);
	}
	/* The VFS counts for the whole process; the store reports what came after its open. */
	struct walvfs_counts vc;
	walvfs_counts(&vc);
	o->wal_syncs = vc.wal_syncs - s->syncs_at_open.wal_syncs;
	o->db_syncs = vc.other_syncs - s->syncs_at_open.other_syncs;
	o->commits_spoiled = vc.spoiled - s->syncs_at_open.spoiled;
	o->spoils_failed = vc.spoil_failed - s->syncs_at_open.spoil_failed;
	o->wal_commits_dropped = s->wal_commits_dropped;
	o->db_bytes = file_bytes(s->path, "");
	o->wal_bytes = file_bytes(s->real, "-wal");
}

bool store_checkpoint_behind(struct store *s)
{
	bool behind;

	if (!s->ck.started ||
	    atomic_load_explicit(&s->ck.wal_frames, memory_order_relaxed) < s->checkpoint_pages)
		return false;
	pthread_mutex_lock(&s->ck.mu);
	behind = s->ck.running || s->ck.wanted;
	pthread_mutex_unlock(&s->ck.mu);
	return behind;
}

uint64_t store_checkpoints(struct store *s)
{
	uint64_t n;

	if (!s->ck.started)
		return 0;
	pthread_mutex_lock(&s->ck.mu);
	n = s->ck.runs;
	pthread_mutex_unlock(&s->ck.mu);
	return n;
}


/* ---- pending records ---- */

static void pending_free(struct pending *p)
{
	for (size_t i = 0; i < p->nbatches; i++)
		free(p->batches[i]);
	free(p->batches);
	free(p->entries);
	free(p->convs);
	free(p->slots);
	memset(p, 0, sizeof(*p));
}

/* Empties p, keeping its arrays for the next cycle (no fresh pages to fault in). */
static void pending_reset(struct pending *p)
{
	for (size_t i = 0; i < p->nbatches; i++)
		free(p->batches[i]);
	p->nbatches = 0;
	p->nentries = 0;
	p->nconvs = 0;
	if (p->slots)
		memset(p->slots, 0, p->nslots * sizeof(*p->slots));
	p->last_seq = 0;
}

static struct pconv *pending_conv(const struct pending *p, const char *id, size_t len,
                                  uint64_t hash)
{
	size_t mask = p->nslots - 1;

	if (!p->nslots)
		return NULL;
	for (size_t i = hash & mask;; i = (i + 1) & mask) {
		uint32_t k = p->slots[i];
		if (!k)
			return NULL;
		struct pconv *c = &p->convs[k - 1];
		if (c->hash == hash && c->id_len == len && memcmp(c->id, id, len) == 0)
			return c;
	}
}

/* Puts every conversation back in a table of nslots (a power of two). */
static void pending_rehash(struct pending *p)
{
	size_t mask = p->nslots - 1;

	memset(p->slots, 0, p->nslots * sizeof(*p->slots));
	for (size_t k = 0; k < p->nconvs; k++) {
		size_t i = p->convs[k].hash & mask;
		while (p->slots[i])
			i = (i + 1) & mask;
		p->slots[i] = (uint32_t)(k + 1);
	}
}

static int grow(void **arr, size_t *cap, size_t need, size_t size, size_t first)
{
	size_t ncap = *cap ? *cap : first;
	void *q;

	if (need <= *cap)
		return 0;
	while (ncap < need)
		ncap *= 2;
	if (!(q = realloc(*arr, ncap * size)))
		return -ENOMEM;
	*arr = q;
	*cap = ncap;
	return 0;
}

/* Room for nbatches more batches of nrec records in all: adding them after their commit
 * cannot fail. */
static int pending_reserve(struct pending *p, size_t nbatches, size_t nrec)
{
	size_t need = p->nconvs + nrec;

	if (need > UINT32_MAX / 2 - 1 ||
	    grow((void **)&p->batches, &p->capbatches, p->nbatches + nbatches, sizeof(*p->batches),
	         64) < 0 ||
	    grow((void **)&p->entries, &p->capentries, p->nentries + nrec, sizeof(*p->entries),
	         1024) < 0 ||
	    grow((void **)&p->convs, &p->capconvs, need, sizeof(*p->convs), 256) < 0)
		return -ENOMEM;
	if (2 * need > p->nslots) {
		size_t n = p->nslots ? p->nslots : 512;
		uint32_t *slots;
		while (n < 2 * need)
			n *= 2;
		if (!(slots = malloc(n * sizeof(*slots))))
			return -ENOMEM;
		free(p->slots);
		p->slots = slots;
		p->nslots = n;
		pending_rehash(p);
	}
	return 0;
}

/* Adds a committed batch (taking data) whose records were checked, with room reserved by
 * pending_reserve. */
static void pending_add(const struct store *s, struct pending *p, char *data, size_t len,
                        uint64_t seq)
{
	struct msgrec r;
	size_t pos = 0, at = 0, mask = p->nslots - 1;

	p->batches[p->nbatches++] = data;
	p->last_seq = seq;
	while (msgrec_next(data, len, &pos, &r) == 1) {
		uint64_t hash = siphash13(s->hash_key, (const unsigned char *)r.conv, r.conv_len);
		struct pconv *c = pending_conv(p, r.conv, r.conv_len, hash);
		size_t e = p->nentries++;

		p->entries[e].rec = data + at;
		p->entries[e].next = SIZE_MAX;
		at = pos;
		/* Tried and not taken: pointing c->id at this record's copy of the id on every
		 * hit, so that the next compare reads a recent batch instead of the first one
		 * (8 paired runs at process: loop CPU a request 5.79 -> 6.00 us, lower in 1). */
		if (c) {
			p->entries[c->last].next = e;
			c->last = e;
			c->n++;
			continue;
		}
		c = &p->convs[p->nconvs++];
		c->id = r.conv;
		c->id_len = r.conv_len;
		c->hash = hash;
		c->first = c->last = e;
		c->n = 1;
		{
			size_t i = hash & mask;
			while (p->slots[i])
				i = (i + 1) & mask;
			p->slots[i] = (uint32_t)p->nconvs;
		}
	}
}

/* Orders a fold cycle's conversations by id, so that their segments go into the index in
 * key order (each leaf written once per cycle, not once per segment). */
static int cmp_pconv(const void *a, const void *b)
{
	const struct pconv *x = a, *y = b;
	int r = memcmp(x->id, y->id, x->id_len < y->id_len ? x->id_len : y->id_len);
	if (r)
		return r;
	return x->id_len < y->id_len ? -1 : x->id_len > y->id_len;
}

/* ---- the fold ---- */

/* A record and its place among those of one read (for ties between equal versions). */
struct cand {
	struct msgrec r;
	size_t order;
};

static int cmp_cand(const void *a, const void *b)
{
	const struct cand *x = a, *y = b;
	size_t n = x->r.sk_len < y->r.sk_len ? x->r.sk_len : y->r.sk_len;
	int c = memcmp(x->r.sk, y->r.sk, n);

	if (c)
		return c;
	if (x->r.sk_len != y->r.sk_len)
		return x->r.sk_len < y->r.sk_len ? -1 : 1;
	if (x->r.version != y->r.version)
		return x->r.version < y->r.version ? -1 : 1;
	return x->order < y->order ? -1 : x->order > y->order;
}

/* Sorts candidates by sort key and keeps the newest of each message (the highest version,
 * the later of equal ones), in sort-key order. Returns how many are left. */
static size_t newest_per_key(struct cand *c, size_t n)
{
	size_t out = 0;

	if (n == 0)
		return 0;
	qsort(c, n, sizeof(*c), cmp_cand);
	for (size_t i = 0; i < n; i++) {
		if (i + 1 < n && c[i + 1].r.sk_len == c[i].r.sk_len &&
		    memcmp(c[i + 1].r.sk, c[i].r.sk, c[i].r.sk_len) == 0)
			continue;
		c[out++] = c[i];
	}
	return out;
}

/* Writes the segment of conversation c of p: its records, the newest of each message.
 * Tried and not taken: a thread of its own building the running cycle's segments ahead
 * of the fold steps, which then only inserted them (handed over under a mutex the step
 * only try-locked; 1024 records ahead at most). It did what it was for: in perf at 50
 * connections, process, the fold's share of the loop fell from 6.8% to 3.3%, and the
 * thread took 0.25 us a request. But in ABBA pairs the loop's CPU a request did not move
 * (12 pairs: 6.29 -> 6.14 us, lower in 7; 16 more: 8.23 -> 8.25, in 7), nor req/s (better
 * in 7 and 6) or p99 (6 and 8); all threads' CPU a request rose. 8192 records ahead gave
 * the thread spells of a few ms, and p99 rose (1.2 -> 1.6 ms, medians of 6). */
static int write_segment(struct store *s, const struct pending *p, const struct pconv *c,
                         struct buf *seg)
{
	sqlite3_stmt *st = s->st[ST_SEGMENT_PUT];
	struct cand small[16], *v = small;
	size_t k = 0;
	int rc = 0;

	if (c->n > sizeof(small) / sizeof(small[0]) && !(v = malloc(c->n * sizeof(*v))))
		return -ENOMEM;
	/* The records lie in their batches, written long before and out of the cache: ask for
	 * all of them, then read them (one miss after another cost the loop 3.5% of its time
	 * under load at process, where the fold runs inside its commits). */
	for (size_t e = c->first, i = 0; e != SIZE_MAX && i < c->n; e = p->entries[e].next) {
		const char *rec = p->entries[e].rec;
		__builtin_prefetch(rec);
		__builtin_prefetch(rec + 64);
		v[i++].r.map = rec; /* where the record starts, until msgrec_next fills r */
	}
	for (size_t i = 0; i < c->n; i++) {
		const char *rec = v[i].r.map;
		size_t pos = 0;
		if (msgrec_next(rec, SIZE_MAX - (uintptr_t)rec, &pos, &v[k].r) == 1) {
			v[k].order = k;
			k++;
		}
	}
	k = newest_per_key(v, k);
	seg->len = 0;
	for (size_t i = 0; i < k && !rc; i++) {
		v[i].r.conv_len = 0; /* the row names the conversation */
		if (msgrec_append(seg, &v[i].r) < 0)
			rc = -ENOMEM;
	}
	if (!rc && k) {
		if ((rc = bind_conv(st, 1, c->id, c->id_len)) != SQLITE_OK ||
		    (rc = sqlite3_bind_blob64(st, 2, seg->data, seg->len, SQLITE_STATIC)) != SQLITE_OK)
			rc = fail(s, st, rc);
		else if ((rc = run(s, st)) == 0)
			s->txn_segments++;
	}
	if (v != small)
		free(v);
	return rc;
}

/* One step of the fold inside the open transaction: starts a cycle when none runs and
 * enough records are pending (or force), then writes the segments of about want records'
 * conversations, or fewer with yield once a job waits (at least one); the cycle's last step
 * marks the table of its batches dead (clear_dead empties it). tx_commit and tx_rollback
 * finish or undo what it did. 0 or -errno. */
static int fold_step(struct store *s, size_t want, bool force, bool yield)
{
	struct buf seg = {NULL, 0, 0};
	size_t folded = 0;
	int rc = 0;

	if (s->cursor >= s->cur.nconvs) {
		if (s->cur.nentries || s->next.nentries == 0 ||
		    (!force && s->next.nentries < s->fold_records))
			return 0;
		struct pending spare = s->cur; /* empty, its arrays kept */
		s->cur = s->next;
		s->next = spare;
		qsort(s->cur.convs, s->cur.nconvs, sizeof(*s->cur.convs), cmp_pconv);
		pending_rehash(&s->cur);
		s->cursor = 0;
		s->txn_fold_started = true;
		for (int i = 0; i < 2; i++)
			if (s->bt[i].state == BT_NEXT)
				s->bt[i].state = BT_CUR;
	}
	while (s->cursor < s->cur.nconvs && folded < want && !rc &&
	       !(yield && folded && atomic_load_explicit(&s->jobs_waiting, memory_order_relaxed))) {
		const struct pconv *c = &s->cur.convs[s->cursor++];
		rc = write_segment(s, &s->cur, c, &seg);
		folded += c->n;
		s->txn_folded += c->n;
	}
	if (!rc && s->cursor >= s->cur.nconvs) {
		for (int i = 0; i < 2; i++)
			if (s->bt[i].state == BT_CUR)
				s->bt[i].state = BT_DEAD;
		s->txn_fold_ended = true;
	}
	buf_free(&seg);
	return rc;
}

/* Batch rows of ended fold cycles, not emptied yet (store_stats' dead_batches). */
static uint64_t dead_rows(const struct store *s)
{
	uint64_t n = 0;
	for (int i = 0; i < 2; i++)
		if (s->bt[i].state == BT_DEAD)
			n += s->bt[i].rows;
	return n;
}

/* Empties the tables of ended fold cycles inside the open transaction. Their batches are
 * older than every batch still to fold (a cycle takes all those committed before it), so a
 * crash before a table is emptied leaves the newest batches, folded or not, which the next
 * start folds again together: each message's newest version among them is at least the one
 * any segment holds (message_get counts on it). 0 or -errno. */
static int clear_dead(struct store *s)
{
	int rc = 0;
	for (int i = 0; i < 2 && !rc; i++) {
		if (s->bt[i].state != BT_DEAD)
			continue;
		if ((rc = run(s, s->st[ST_BATCH_CLEAR + i])) == 0) {
			s->bt[i].state = BT_EMPTY;
			s->bt[i].rows = 0;
		}
	}
	return rc;
}

/* The table the open transaction's batches go to: the one of the next cycle's, else an
 * empty one, else a dead one, emptied first. 0 or 1, or -errno.
 *
 * Neither is free only when a start replayed what a crash left in both tables, could not
 * fold it (a full disk), and a later cycle took it all. That cycle is then finished here,
 * and both tables emptied: the batches of the next cycle cannot go beside those of the
 * cycle under way, which a table is emptied with, and emptying one table while the other
 * still held older batches would let a crash bring back an older version than a segment's
 * as the newest (see clear_dead). */
static int batch_table(struct store *s)
{
	static const enum bt_state order[] = {BT_NEXT, BT_EMPTY, BT_DEAD};
	int rc = 0;

	for (size_t k = 0; k < sizeof(order) / sizeof(order[0]); k++)
		for (int i = 0; i < 2; i++)
			if (s->bt[i].state == order[k])
				return order[k] == BT_DEAD && (rc = clear_dead(s)) < 0 ? rc : i;
	while (!rc && s->cursor < s->cur.nconvs)
		rc = fold_step(s, SIZE_MAX, false, false);
	if (!rc)
		rc = clear_dead(s);
	return rc;
}

/* ---- the writer's transactions ---- */

/* At durability machine: synchronous=FULL set back after a fold's transaction at NORMAL
 * (or refused, when a test asked for it). An SQLite result code. */
static int sync_full(struct store *s)
{
	if (s->fail_sync_full) {
		s->sync_full_failures++;
		return SQLITE_NOMEM;
	}
	return sqlite3_exec(s->db, "PRAGMA synchronous=FULL", NULL, NULL, NULL);
}

/* One SQLite transaction of the writer (or of the thread that opens or closes the store,
 * when the writer is not running). The fold step inside it is finished or undone with it. */
static int tx_begin(struct store *s)
{
	/* The fold's progress as it stands, first: a caller rolls back a transaction that
	 * failed to begin too, which must then put back this, not the last one's. */
	s->txn_cursor = s->cursor;
	memcpy(s->txn_bt, s->bt, sizeof(s->bt));
	s->txn_fold_started = s->txn_fold_ended = false;
	s->txn_segments = s->txn_folded = 0;
	/* At machine, synchronous=FULL could not be set back after a fold (fold_idle): no
	 * commit goes unsynced. */
	if (s->sync_lost) {
		if (sync_full(s) != SQLITE_OK)
			return -EIO;
		s->sync_lost = false;
	}
	return run(s, s->st[ST_BEGIN]);
}

static void tx_rollback(struct store *s)
{
	/* SQLite rolls some failures (a full disk, I/O errors) back by itself. */
	if (!sqlite3_get_autocommit(s->db))
		run(s, s->st[ST_ROLLBACK]);
	/* The fold's segments are gone with the transaction: so is its progress. */
	s->cursor = s->txn_cursor;
	memcpy(s->bt, s->txn_bt, sizeof(s->bt));
	if (s->txn_fold_started) {
		struct pending spare = s->next;
		s->next = s->cur;
		s->cur = spare;
		s->cursor = 0;
	}
	s->txn_fold_started = s->txn_fold_ended = false;
}

/* Commits; on failure rolls back. */
static int tx_commit(struct store *s)
{
	int rc = run(s, s->st[ST_COMMIT]);
	if (rc < 0) {
		tx_rollback(s);
		return rc;
	}
	if (s->txn_fold_ended) {
		pending_reset(&s->cur);
		s->cursor = 0;
		count_add(&s->n.fold_cycles, 1);
	}
	count_add(&s->n.fold_segments, s->txn_segments);
	count_add(&s->n.fold_records, s->txn_folded);
	count_set(&s->n.pending, s->cur.nentries + s->next.nentries);
	count_set(&s->n.dead_batches, dead_rows(s));
	s->txn_fold_started = s->txn_fold_ended = false;
	s->txn_segments = s->txn_folded = 0;
	if (s->ck.started)
		checkpoint_catch_up(&s->ck, s->db);
	return 0;
}

/* Folds everything pending and empties the tables of folded batches, in transactions of
 * its own. 0 or -errno. */
static int settle(struct store *s)
{
	int rc = 0;

	while (!rc && (s->cur.nentries || s->next.nentries || dead_rows(s))) {
		if ((rc = tx_begin(s)) < 0)
			break;
		if ((rc = fold_step(s, SIZE_MAX, true, false)) < 0 || (rc = clear_dead(s)) < 0) {
			tx_rollback(s);
			break;
		}
		rc = tx_commit(s);
	}
	return rc;
}

/* Reads the batches a crash left into the pending records (store_open then folds them). */
static int replay_batches(struct store *s)
{
	sqlite3_stmt *st = s->st[ST_BATCH_EACH];
	int rc = 0, step;

	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		int64_t seq = sqlite3_column_int64(st, 0);
		const char *data = sqlite3_column_blob(st, 1);
		size_t len = (size_t)sqlite3_column_bytes(st, 1), pos = 0, n = 0, good = 0;
		struct batch_table *t = &s->bt[sqlite3_column_int(st, 2) == 1];
		struct msgrec r;
		char *copy;
		int got;

		while ((got = msgrec_next(data, len, &pos, &r)) == 1) {
			n++;
			good = pos;
		}
		if (got < 0)
			log_msg(LOG_ERROR, "store",
			        "%s: journal row %" PRId64 " is damaged after %zu records; the rest "
			        "of it is lost",
			        s->path, seq, n);
		if (!(copy = malloc(good ? good : 1)) || pending_reserve(&s->next, 1, n) < 0) {
			free(copy);
			rc = -ENOMEM;
			break;
		}
		if (good)
			memcpy(copy, data, good);
		pending_add(s, &s->next, copy, good, (uint64_t)seq);
		t->state = BT_NEXT;
		t->rows++;
		if ((uint64_t)seq > s->submitted)
			s->submitted = s->committed = (uint64_t)seq;
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	count_set(&s->n.pending, s->next.nentries);
	return rc;
}

/* ---- the writes of a transaction, as the loop records them ---- */

/* Besides message records, a transaction's writes are ops, packed into its ops buffer and
 * applied in order by the writer. */
enum op_kind {
	OPK_PUT_CONVERSATION = 1, /* conv, updated */
	OPK_SET_CLOSED,           /* conv, closed_ms */
	OPK_SPOOL_PUT,            /* conv, sk, version, map_bytes, now_ms */
	OPK_SPOOL_DONE,           /* conv, sk, version */
	OPK_DEAD_LETTER,          /* conv, sk, version, item (or none), error, now_ms */
	OPK_REPAIR_PUT,           /* conv, sk, version, due_ms */
	OPK_REPAIR_DONE,          /* conv, sk, version */
};

#define NO_TEXT UINT32_MAX /* a NULL item */

static int put_u64(struct buf *b, uint64_t v)
{
	unsigned char p[8];
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
	return buf_append(b, p, 8);
}

static int put_bytes(struct buf *b, const char *p, size_t n)
{
	if (n > UINT32_MAX - 1 || put_u64(b, n) < 0)
		return -ENOMEM;
	return n ? buf_append(b, p, n) : 0;
}

struct store_op {
	enum op_kind kind;
	const char *conv, *sk, *item, *error;
	size_t conv_len, sk_len, item_len, error_len;
	uint64_t version, map_bytes;
	int64_t when;
};

/* Appends op to the open transaction's ops. */
static int op_record(struct store *s, const struct store_op *o)
{
	struct buf *b = &s->ops;
	size_t mark = b->len;
	unsigned char kind = (unsigned char)o->kind;
	int rc = buf_append(b, &kind, 1);

	if (!rc)
		rc = put_bytes(b, o->conv, o->conv_len);
	if (!rc)
		rc = put_bytes(b, o->sk ? o->sk : "", o->sk_len);
	if (!rc)
		rc = put_u64(b, o->version);
	if (!rc)
		rc = put_u64(b, o->map_bytes);
	if (!rc)
		rc = put_u64(b, (uint64_t)o->when);
	if (!rc)
		rc = o->item ? put_bytes(b, o->item, o->item_len) : put_u64(b, NO_TEXT);
	if (!rc)
		rc = put_bytes(b, o->error ? o->error : "", o->error_len);
	if (rc) {
		b->len = mark;
		return -ENOMEM;
	}
	return 0;
}

static uint64_t get_u64(const char **p)
{
	const unsigned char *q = (const unsigned char *)*p;
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = (v << 8) | q[i];
	*p += 8;
	return v;
}

static const char *get_bytes(const char **p, size_t *n)
{
	const char *s;
	*n = (size_t)get_u64(p);
	if (*n == NO_TEXT) {
		*n = 0;
		return NULL;
	}
	s = *p;
	*p += *n;
	return s;
}

/* The next op of an ops buffer (written by op_record: well formed). */
static const char *op_read(const char *p, struct store_op *o)
{
	o->kind = (enum op_kind)(unsigned char)*p++;
	o->conv = get_bytes(&p, &o->conv_len);
	o->sk = get_bytes(&p, &o->sk_len);
	o->version = get_u64(&p);
	o->map_bytes = get_u64(&p);
	o->when = (int64_t)get_u64(&p);
	o->item = get_bytes(&p, &o->item_len);
	o->error = get_bytes(&p, &o->error_len);
	return p;
}

/* Binds conversation (?1) and sk (?2) of op o. */
static int bind_op_key(struct store *s, sqlite3_stmt *st, const struct store_op *o)
{
	int rc;
	if ((rc = bind_conv(st, 1, o->conv, o->conv_len)) != SQLITE_OK ||
	    (rc = sqlite3_bind_text64(st, 2, o->sk ? o->sk : "", o->sk_len, SQLITE_STATIC,
	                              SQLITE_UTF8)) != SQLITE_OK)
		return fail(s, st, rc);
	return 0;
}

/* Deletes the spool row of (conv, sk) if its version is at most version. */
static int spool_delete(struct store *s, const struct store_op *o)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_DELETE];
	int rc;
	if ((rc = bind_op_key(s, st, o)) < 0)
		return rc;
	if ((rc = sqlite3_bind_int64(st, 3, (sqlite3_int64)o->version)) != SQLITE_OK)
		return fail(s, st, rc);
	return run(s, st);
}

/* Runs one op inside the writer's transaction. */
static int op_apply(struct store *s, const struct store_op *o)
{
	sqlite3_stmt *st;
	int rc;

	switch (o->kind) {
	case OPK_PUT_CONVERSATION:
	case OPK_SET_CLOSED:
		st = s->st[o->kind == OPK_PUT_CONVERSATION ? ST_PUT_CONVERSATION : ST_SET_CLOSED];
		if ((rc = bind_conv(st, 1, o->conv, o->conv_len)) != SQLITE_OK ||
		    (rc = sqlite3_bind_int64(st, 2, o->when)) != SQLITE_OK)
			return fail(s, st, rc);
		return run(s, st);
	case OPK_SPOOL_PUT:
		st = s->st[ST_SPOOL_PUT];
		if ((rc = bind_op_key(s, st, o)) < 0)
			return rc;
		if ((rc = sqlite3_bind_int64(st, 3, (sqlite3_int64)o->version)) != SQLITE_OK ||
		    (rc = sqlite3_bind_int64(st, 4, o->when)) != SQLITE_OK ||
		    (rc = sqlite3_bind_int64(st, 5, (sqlite3_int64)o->map_bytes)) != SQLITE_OK)
			return fail(s, st, rc);
		return run(s, st);
	case OPK_SPOOL_DONE:
		st = s->st[ST_CONFIRM];
		if ((rc = spool_delete(s, o)) < 0 || (rc = bind_op_key(s, st, o)) < 0)
			return rc;
		if ((rc = sqlite3_bind_int64(st, 3, (sqlite3_int64)o->version)) != SQLITE_OK)
			return fail(s, st, rc);
		return run(s, st);
	case OPK_DEAD_LETTER:
		st = s->st[ST_DEAD_INSERT];
		if ((rc = bind_op_key(s, st, o)) < 0)
			return rc;
		if ((rc = sqlite3_bind_int64(st, 3, (sqlite3_int64)o->version)) != SQLITE_OK ||
		    (rc = o->item ? sqlite3_bind_text64(st, 4, o->item, o->item_len, SQLITE_STATIC,
		                                        SQLITE_UTF8)
		                  : sqlite3_bind_null(st, 4)) != SQLITE_OK ||
		    (rc = sqlite3_bind_text64(st, 5, o->error ? o->error : "", o->error_len,
		                              SQLITE_STATIC, SQLITE_UTF8)) != SQLITE_OK ||
		    (rc = sqlite3_bind_int64(st, 6, o->when)) != SQLITE_OK)
			return fail(s, st, rc);
		if ((rc = run(s, st)) < 0)
			return rc;
		return spool_delete(s, o);
	case OPK_REPAIR_PUT:
	case OPK_REPAIR_DONE:
		st = s->st[o->kind == OPK_REPAIR_PUT ? ST_REPAIR_PUT : ST_REPAIR_DELETE];
		if ((rc = bind_op_key(s, st, o)) < 0)
			return rc;
		if ((rc = sqlite3_bind_int64(st, 3, (sqlite3_int64)o->version)) != SQLITE_OK ||
		    (o->kind == OPK_REPAIR_PUT &&
		     (rc = sqlite3_bind_int64(st, 4, o->when)) != SQLITE_OK))
			return fail(s, st, rc);
		return run(s, st);
	}
	return -EINVAL;
}

/* ---- the writer thread ---- */

/* Commits are written by a thread of their own, so that the loop goes on serving while
 * SQLite writes (and, at durability machine, syncs): store_submit queues a transaction's
 * writes as a job, the writer takes every job queued, writes them in one SQLite transaction
 * (the group commit grows with the load) with a fold step, and reports through wake and
 * store_progress. Jobs are committed in the order they were submitted. The connection and
 * the pending records are the writer's while it writes (dbmu); the loop's reads take dbmu
 * too, between two of the writer's transactions. */
enum job_kind { JOB_WRITE = 0, JOB_RETRY_DEAD, JOB_PURGE };

struct job {
	struct job *next;
	enum job_kind kind;
	uint64_t seq;
	char *recs; /* message records (owned) */
	size_t recs_len, nrecs;
	char *ops; /* ops (owned) */
	size_t ops_len;
	int64_t arg;    /* now_ms for JOB_RETRY_DEAD, before_ms for JOB_PURGE */
	size_t result;  /* dead letters retried, conversations purged */
	/* JOB_RETRY_DEAD: the last seq it may move (< 0: the newest, filled in), how many rows
	 * at most (0: all), and whether some are left after them. */
	int64_t upto;
	size_t max_rows;
	bool more;
	bool sync;      /* a thread waits for it: the writer reports into it, the waiter frees */
	bool done;
	int rc;
};

static void job_free(struct job *j)
{
	if (!j)
		return;
	free(j->recs);
	free(j->ops);
	free(j);
}

/* Writes jobs (all JOB_WRITE) in one transaction. 0 or -errno (rolled back). */
static int write_jobs(struct store *s, struct job *jobs)
{
	size_t recs = 0, nbatches = 0, njobs = 0;
	uint64_t t0 = mono_ns();
	int rc = tx_begin(s), table = 0;

	for (struct job *j = jobs; j && !rc; j = j->next) {
		const char *p = j->ops, *end = j->ops + j->ops_len;
		njobs++;
		recs += j->nrecs;
		nbatches += j->recs_len ? 1 : 0;
		while (p && p < end && !rc) {
			struct store_op o;
			p = op_read(p, &o);
			rc = op_apply(s, &o);
		}
	}
	/* The table of the last cycle's batches is emptied by the first commit after the one
	 * that ended the cycle (unless the writer's idle step came first): not by that commit,
	 * already a long one. */
	if (!rc)
		rc = clear_dead(s);
	/* The fold runs while the writer has nothing to write (fold_idle); in a commit only
	 * once it fell far behind. At durability process under load that is where it runs: the
	 * loop writes every commit itself (store_submit) and nothing wakes the sleeping
	 * writer. Waking it to fold took 1.1 us a request off the loop, but in 20 s paired runs
	 * at 50 connections gained no req/s (79-82k either way) and cost p99 (1.8-1.9 ->
	 * 2.1-2.4 ms): the commits the loop hands over while the writer folds wait for it.
	 * Measured again with the loop at 99% of a CPU and the other half idle (a fold step
	 * here is 8.5% of the loop's time; commits with one take 117 us, 40 us without): 5
	 * paired runs, p99 higher in all 5 (0.92-1.02 -> 0.98-1.43 ms), req/s in 3. */
	if (!rc && s->cur.nentries + s->next.nentries >= STORE_FOLD_BEHIND(s))
		rc = fold_step(s, recs > STORE_FOLD_STEP_MIN ? recs : STORE_FOLD_STEP_MIN, false,
		               false);
	/* Room for the new batches, and their table, after the step (which may have started a
	 * cycle). */
	if (!rc && pending_reserve(&s->next, nbatches, recs) < 0)
		rc = -ENOMEM;
	if (!rc && nbatches && (table = batch_table(s)) < 0)
		rc = table;
	for (struct job *j = jobs; j && !rc; j = j->next) {
		sqlite3_stmt *st = s->st[ST_BATCH_PUT + table];
		if (!j->recs_len)
			continue;
		if ((rc = sqlite3_bind_int64(st, 1, (sqlite3_int64)j->seq)) != SQLITE_OK ||
		    (rc = sqlite3_bind_blob64(st, 2, j->recs, j->recs_len, SQLITE_STATIC)) !=
		        SQLITE_OK)
			rc = fail(s, st, rc);
		else if ((rc = run(s, st)) == 0) {
			s->bt[table].state = BT_NEXT;
			s->bt[table].rows++;
		}
	}
	if (rc) {
		if (rc != -ENOSPC && rc != -EIO && rc != -ENOMEM)
			rc = -EIO;
		tx_rollback(s);
		return rc;
	}
	if ((rc = tx_commit(s)) < 0)
		return rc;
	for (struct job *j = jobs; j; j = j->next) {
		if (!j->recs_len)
			continue;
		pending_add(s, &s->next, j->recs, j->recs_len, j->seq);
		j->recs = NULL; /* the pending records own it now */
	}
	count_set(&s->n.pending, s->cur.nentries + s->next.nentries);
	t0 = mono_ns() - t0;
	count_add(&s->n.commits, 1);
	count_add(&s->n.turns, njobs);
	count_add(&s->n.records, recs);
	count_add(&s->n.commit_ns, t0);
	/* Only this thread (or the loop, with the connection held) writes it. */
	if (t0 > count_get(&s->n.commit_max_ns))
		count_set(&s->n.commit_max_ns, t0);
	return 0;
}

/* Where a part of a retry (j) ends: *bound, the seq of its last row, and j->more; j->upto
 * is filled in first when the retry starts. */
static int dead_bound(struct store *s, struct job *j, int64_t *bound)
{
	sqlite3_stmt *st = s->st[ST_DEAD_LAST];
	int step, rc;

	j->more = false;
	if (j->upto < 0) {
		if ((step = sqlite3_step(st)) == SQLITE_ROW)
			j->upto = sqlite3_column_int64(st, 0);
		rc = step == SQLITE_ROW ? 0 : fail(s, st, step);
		sqlite3_reset(st);
		if (rc)
			return rc;
	}
	*bound = j->upto;
	if (!j->max_rows)
		return 0;
	st = s->st[ST_DEAD_BOUND];
	if ((rc = sqlite3_bind_int64(st, 1, j->upto)) != SQLITE_OK ||
	    (rc = sqlite3_bind_int64(st, 2, (int64_t)j->max_rows - 1)) != SQLITE_OK)
		return fail(s, st, rc);
	if ((step = sqlite3_step(st)) == SQLITE_ROW) {
		*bound = sqlite3_column_int64(st, 0);
		if ((step = sqlite3_step(st)) == SQLITE_ROW) {
			j->more = true;
			step = SQLITE_DONE;
		}
	}
	rc = step == SQLITE_DONE ? 0 : fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

/* The jobs that are not writes: each on its own, in transactions of their own. */
static int run_special(struct store *s, struct job *j)
{
	int rc = 0;

	switch (j->kind) {
	case JOB_RETRY_DEAD: {
		sqlite3_stmt *st = s->st[ST_DEAD_TO_SPOOL], *clear = s->st[ST_DEAD_CLEAR];
		int64_t bound = 0;
		if ((rc = tx_begin(s)) < 0)
			return rc;
		if ((rc = dead_bound(s, j, &bound)) < 0)
			;
		else if ((rc = sqlite3_bind_int64(st, 1, j->arg)) != SQLITE_OK ||
		         (rc = sqlite3_bind_int64(st, 2, bound)) != SQLITE_OK)
			rc = fail(s, st, rc);
		else if ((rc = sqlite3_bind_int64(clear, 1, bound)) != SQLITE_OK)
			rc = fail(s, clear, rc);
		else if ((rc = run(s, st)) == 0 && (rc = run(s, clear)) == 0)
			j->result = (size_t)sqlite3_changes64(s->db);
		if (rc) {
			tx_rollback(s);
			return rc;
		}
		return tx_commit(s);
	}
	case JOB_PURGE:
		/* Pending records of a purged conversation would be folded into segments later. */
		if ((rc = settle(s)) < 0 || (rc = tx_begin(s)) < 0)
			return rc;
		for (int i = ST_PURGE_SEGMENTS; !rc && i <= ST_PURGE_CONVERSATIONS; i++) {
			if ((rc = sqlite3_bind_int64(s->st[i], 1, j->arg)) != SQLITE_OK)
				rc = fail(s, s->st[i], rc);
			else
				rc = run(s, s->st[i]);
		}
		if (!rc)
			j->result = (size_t)sqlite3_changes64(s->db);
		if (rc) {
			tx_rollback(s);
			return rc;
		}
		return tx_commit(s);
	case JOB_WRITE:
		break;
	}
	return -EINVAL;
}

/* The WAL went past STORE_WAL_HARD_PAGES in a commit the loop wrote: wal_hook's hard case,
 * taken by the writer with the connection held, so that no commit comes in between. */
static void wal_bound(struct store *s)
{
	checkpoint_after_round(&s->ck, s->db, NULL, &s->dbmu);
}

/* Is there fold work: a cycle under way, enough pending to start one (or anything pending
 * at all), or a table of folded batches to empty? (dbmu held) */
static bool fold_wanted(const struct store *s, bool all)
{
	return s->cursor < s->cur.nconvs || s->next.nentries >= s->fold_records ||
	       (all && s->next.nentries) || dead_rows(s);
}

/* The daemon is idle and everything pending is folded: the memory that held it and SQLite's
 * page cache go back to the system. */
static void idle_release(struct store *s)
{
	pthread_mutex_lock(&s->dbmu);
	if (!s->cur.nentries && !s->next.nentries) {
		pending_free(&s->cur);
		pending_free(&s->next);
		s->cursor = 0;
	}
	/* The page cache refills as needed. */
	sqlite3_db_release_memory(s->db);
	pthread_mutex_unlock(&s->dbmu);
	malloc_trim(0);
	/* And the WAL goes back into the database: a quiet daemon's writes would otherwise
	 * stay there until STORE_CHECKPOINT_PAGES. */
	if (s->ck.started)
		checkpoint_ask(&s->ck);
}

/* A step of the fold (of everything pending when all is set) in a transaction of its own,
 * while no job waits. It is not synced, even
 * at durability machine: the journal rows it folds stay until a later transaction deletes
 * them, so a fold lost to a power cut is folded again. A failure (a full disk) is tried
 * again later. Returns whether there is more to fold. */
static bool fold_idle(struct store *s, bool all)
{
	bool more;

	pthread_mutex_lock(&s->dbmu);
	if ((more = fold_wanted(s, all))) {
		uint64_t t0 = mono_ns();
		if (s->durability == DURABILITY_MACHINE)
			sqlite3_exec(s->db, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
		if (tx_begin(s) < 0) {
			more = false; /* as below: not again before the next job */
		} else if (clear_dead(s) < 0 || fold_step(s, STORE_FOLD_IDLE_STEP, all, true) < 0) {
			tx_rollback(s);
			more = false;
		} else if (tx_commit(s) < 0) {
			more = false;
		}
		if (s->durability == DURABILITY_MACHINE && sync_full(s) != SQLITE_OK)
			s->sync_lost = true; /* the next transaction sets it, or fails */
		count_add(&s->n.fold_ns, mono_ns() - t0);
		more = more && fold_wanted(s, all);
	}
	pthread_mutex_unlock(&s->dbmu);
	return more;
}

/* At durability machine a commit is mostly its sync, and the requests its answers release
 * come back while the next commit syncs: left alone, 50 connections settle into two cohorts
 * of about 21 records a commit. After a commit of several records the writer waits a
 * little, until three quarters as many records as it released are queued beyond those
 * already waiting, so that one commit carries most of both cohorts. It waits at most
 * STORE_COHORT_WAIT_NS after that commit ended, not while a thread waits for a job of its
 * own (job_run_sync) or a special job is queued, and not right after a wait that fell short
 * (the clients it released did not come back in time). The waits, those that fell short and
 * their time are counted (store_stats). */
static void cohort_wait(struct store *s)
{
	struct timespec dl;
	uint64_t end, t0 = 0;
	size_t want;

	if (s->durability != DURABILITY_MACHINE || s->cohort_records < 2)
		return;
	if (s->cohort_missed) {
		s->cohort_missed = false;
		return;
	}
	want = s->cohort_queued + s->cohort_records * 3 / 4;
	end = s->cohort_end_ns + s->cohort_wait_ns;
	dl.tv_sec = (time_t)(end / 1000000000u);
	dl.tv_nsec = (long)(end % 1000000000u);
	while (s->queued_records < want && !s->stop && !s->wal_full && !s->idle_wanted) {
		for (struct job *j = s->queue; j; j = j->next)
			if (j->sync || j->kind != JOB_WRITE)
				goto out;
		if (!t0) {
			/* A deadline already past (after an idle spell) is a miss, not a wait. */
			if ((t0 = mono_ns()) >= end) {
				s->cohort_missed = true;
				return;
			}
			count_add(&s->n.cohort_waits, 1);
		}
		if (pthread_cond_timedwait(&s->qcv, &s->qmu, &dl) == ETIMEDOUT) {
			s->cohort_missed = s->queued_records < want;
			count_add(&s->n.cohort_short, s->cohort_missed);
			break;
		}
	}
out:
	if (t0)
		count_add(&s->n.cohort_ns, mono_ns() - t0);
}

static void *writer_main(void *arg)
{
	struct store *s = arg;
	bool fold = true;

	pthread_mutex_lock(&s->qmu);
	for (;;) {
		struct job *jobs, *keep = NULL, **kp = &keep, *j, *next;
		bool had;
		int rc = 0;

		/* Between jobs, in steps short enough for a job not to wait long: the checkpoint
		 * that bounds the WAL, the fold, and for an idle daemon the rest of the fold and
		 * giving memory back. */
		while ((s->wal_full || (fold && !s->no_idle_fold) || s->idle_wanted) && !s->queue &&
		       !s->stop) {
			bool full = s->wal_full, idle = s->idle_wanted;
			s->wal_full = false;
			pthread_mutex_unlock(&s->qmu);
			if (full) {
				wal_bound(s);
			} else if (!(fold = fold_idle(s, idle)) && idle) {
				idle_release(s);
				pthread_mutex_lock(&s->qmu);
				s->idle_wanted = false;
				pthread_mutex_unlock(&s->qmu);
			}
			pthread_mutex_lock(&s->qmu);
		}
		while (!s->queue && !s->stop && !s->wal_full && !s->idle_wanted)
			pthread_cond_wait(&s->qcv, &s->qmu);
		if (!s->queue && !s->stop)
			continue;
		fold = true;
		if (!s->queue)
			break;
		cohort_wait(s);
		/* The writes queued now, up to the first special job; or that job alone. */
		jobs = s->queue;
		if (jobs->kind != JOB_WRITE) {
			s->queue = jobs->next;
			jobs->next = NULL;
		} else {
			struct job **pp = &jobs->next;
			while (*pp && (*pp)->kind == JOB_WRITE)
				pp = &(*pp)->next;
			s->queue = *pp;
			*pp = NULL;
		}
		if (!s->queue) {
			s->queue_tail = NULL;
			atomic_store_explicit(&s->jobs_waiting, false, memory_order_relaxed);
		}
		/* Jobs submitted before a failure was acknowledged are void: the loop has put
		 * memory back as the store holds it. */
		for (j = jobs; j; j = next) {
			next = j->next;
			j->next = NULL;
			s->queued_records -= j->nrecs;
			if (s->failed || j->seq <= s->void_through) {
				j->rc = -ECANCELED;
				j->done = true;
				if (!j->sync)
					job_free(j);
				continue;
			}
			*kp = j;
			kp = &j->next;
		}
		s->busy = had = keep != NULL;
		pthread_mutex_unlock(&s->qmu);

		if (keep) {
			pthread_mutex_lock(&s->dbmu);
			rc = keep->kind == JOB_WRITE ? write_jobs(s, keep) : run_special(s, keep);
			pthread_mutex_unlock(&s->dbmu);
		}

		pthread_mutex_lock(&s->qmu);
		if (rc && keep && keep->kind == JOB_WRITE) {
			s->failed = true;
			s->fail_error = rc;
		}
		if (!rc && keep && keep->kind == JOB_WRITE) {
			s->cohort_records = 0;
			s->cohort_queued = s->queued_records;
			s->cohort_end_ns = mono_ns();
		}
		for (j = keep; j; j = next) {
			next = j->next;
			j->next = NULL;
			if (!rc && j->kind == JOB_WRITE)
				s->cohort_records += j->nrecs;
			if (!rc && j->seq > s->committed)
				s->committed = j->seq;
			j->rc = rc;
			j->done = true;
			if (!j->sync)
				job_free(j);
		}
		s->busy = false;
		pthread_cond_broadcast(&s->qcv);
		if (had && s->wake) {
			pthread_mutex_unlock(&s->qmu);
			s->wake(s->wake_arg);
			pthread_mutex_lock(&s->qmu);
		}
	}
	pthread_mutex_unlock(&s->qmu);
	return NULL;
}

static int locks_init(struct store *s)
{
	int rc;

	if ((rc = pthread_mutex_init(&s->qmu, NULL)) != 0)
		return -rc;
	if ((rc = pthread_mutex_init(&s->dbmu, NULL)) != 0) {
		pthread_mutex_destroy(&s->qmu);
		return -rc;
	}
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	rc = pthread_cond_init(&s->qcv, &ca);
	pthread_condattr_destroy(&ca);
	if (rc != 0) {
		pthread_mutex_destroy(&s->dbmu);
		pthread_mutex_destroy(&s->qmu);
		return -rc;
	}
	s->locks_ready = true;
	return 0;
}

static int writer_start(struct store *s)
{
	int rc = pthread_create(&s->writer, NULL, writer_main, s);
	if (rc != 0)
		return -rc;
	s->writer_started = true;
	thread_name(s->writer, "convod-writer");
	return 0;
}

/* Writes what is queued, then ends the thread. */
static void writer_stop(struct store *s)
{
	if (!s->writer_started)
		return;
	pthread_mutex_lock(&s->qmu);
	s->stop = true;
	pthread_cond_signal(&s->qcv);
	pthread_mutex_unlock(&s->qmu);
	pthread_join(s->writer, NULL);
	s->writer_started = false;
}

/* Queues j (owned by the queue from now on, unless sync: do not touch it after) and wakes
 * the writer. Returns its sequence number. */
static uint64_t job_queue(struct store *s, struct job *j)
{
	uint64_t seq;

	pthread_mutex_lock(&s->qmu);
	j->seq = seq = ++s->submitted;
	s->queued_records += j->nrecs;
	if (s->queue_tail)
		s->queue_tail->next = j;
	else
		s->queue = j;
	s->queue_tail = j;
	atomic_store_explicit(&s->jobs_waiting, true, memory_order_relaxed);
	pthread_cond_signal(&s->qcv);
	pthread_mutex_unlock(&s->qmu);
	return seq;
}

/* Runs j to its end and returns its rc; j stays the caller's. */
static int job_run_sync(struct store *s, struct job *j)
{
	j->sync = true;
	job_queue(s, j);
	pthread_mutex_lock(&s->qmu);
	while (!j->done)
		pthread_cond_wait(&s->qcv, &s->qmu);
	pthread_mutex_unlock(&s->qmu);
	return j->rc;
}

void store_set_wake(struct store *s, void (*wake)(void *arg), void *arg)
{
	pthread_mutex_lock(&s->qmu);
	s->wake = wake;
	s->wake_arg = arg;
	pthread_mutex_unlock(&s->qmu);
}

void store_progress(struct store *s, struct store_progress *p)
{
	pthread_mutex_lock(&s->qmu);
	p->submitted = s->submitted;
	p->committed = s->committed;
	p->failed = s->failed;
	p->error = s->fail_error;
	pthread_mutex_unlock(&s->qmu);
}

void store_failure_ack(struct store *s)
{
	pthread_mutex_lock(&s->qmu);
	if (s->failed) {
		s->failed = false;
		s->void_through = s->submitted;
	}
	pthread_mutex_unlock(&s->qmu);
}

/* ---- open and close ---- */

/* path with the links of its last name followed, as SQLite's unix VFS follows them (at most
 * 200, its SQLITE_MAX_SYMLINK since 3.39; a link's relative target is taken from the
 * link's directory): the database SQLite opens as path, beside which it keeps the WAL and
 * -shm. A copy, or NULL (ENOMEM). A link that leads nowhere is followed as far as it goes:
 * SQLite creates the file it names. Where a target's ".." follows a directory that does
 * not exist, SQLite drops both by their names and the kernel would not: the two differ,
 * and the check looks where SQLite does not. */
static char *links_followed(const char *path)
{
	char *p = strdup(path), target[PATH_MAX], *slash, *dir;
	struct stat st;
	ssize_t n;
	int i;

	for (i = 0; p && i < 200 && lstat(p, &st) == 0 && S_ISLNK(st.st_mode); i++) {
		if ((n = readlink(p, target, sizeof(target) - 1)) <= 0)
			break;
		target[n] = '\0';
		slash = strrchr(p, '/');
		size_t keep = target[0] != '/' && slash ? (size_t)(slash - p) + 1 : 0;
		char *q = malloc(keep + (size_t)n + 1);
		if (q) {
			memcpy(q, p, keep);
			memcpy(q + keep, target, (size_t)n + 1);
		}
		free(p);
		p = q;
	}
	/* For messages: DIR/../elsewhere/file as /elsewhere/file. */
	if (i && p && (slash = strrchr(p, '/')) && slash != p) {
		*slash = '\0';
		dir = realpath(p, NULL);
		*slash = '/';
		char *q = dir ? malloc(strlen(dir) + strlen(slash) + 1) : NULL;
		if (q) {
			strcpy(q, dir);
			strcat(q, slash);
			free(p);
			p = q;
		}
		free(dir);
	}
	return p;
}

/* Copies the file open on fd to path, synced with its directory: written as path.part,
 * then renamed, so that path is whole whenever it is there. 0, -EEXIST when path is there
 * already, or -errno. */
static int copy_synced(int fd, const char *path)
{
	char buf[65536], part[PATH_MAX + 80], dir[PATH_MAX + 80], *slash;
	int out, dfd, rc = 0;
	off_t off = 0;

	if (access(path, F_OK) == 0)
		return -EEXIST;
	snprintf(part, sizeof(part), "%s.part", path);
	if ((out = open(part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
		return -errno;
	for (;;) {
		ssize_t n = pread(fd, buf, sizeof(buf), off), w = 0;
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			rc = n < 0 ? -errno : 0;
			break;
		}
		while (w < n) {
			ssize_t k = write(out, buf + w, (size_t)(n - w));
			if (k < 0 && errno == EINTR)
				continue;
			if (k < 0)
				break;
			w += k;
		}
		if (w < n) {
			rc = -errno;
			break;
		}
		off += n;
	}
	if (rc == 0 && fsync(out) < 0)
		rc = -errno;
	if (close(out) < 0 && rc == 0)
		rc = -errno;
	if (rc == 0 && rename(part, path) < 0)
		rc = -errno;
	if (rc < 0) {
		unlink(part);
		return rc;
	}
	snprintf(dir, sizeof(dir), "%s", path);
	if ((slash = strrchr(dir, '/')))
		*slash = '\0';
	if ((dfd = open(slash ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)) >= 0) {
		fsync(dfd);
		close(dfd);
	}
	return 0;
}

/* The page size convod.db's header names (its bytes 16-17, 1 for 65536), or 0. */
static uint32_t db_page_size(const char *path)
{
	unsigned char b[2];
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	uint32_t n = 0;

	if (fd >= 0 && pread(fd, b, 2, 16) == 2)
		n = (uint32_t)b[0] << 8 | b[1];
	if (fd >= 0)
		close(fd);
	return n == 1 ? 65536 : n;
}

/* Before SQLite's recovery reads the WAL (walcheck.h): intact commits beyond the point
 * where that recovery stops, which it drops without a word (and the next commit writes
 * over). The last commit of the file alone, with a frame of its own not as written and no
 * other commit broken before it, is what a power loss during its write leaves (the disk
 * kept its commit frame and not an earlier one): a warning. Anything more is a file
 * damaged after it was written, or a power loss that kept later writes of several commits
 * and lost earlier ones (at process no commit is synced; at machine the fold's idle steps
 * are not, nor is the commit under way, and none of those was acknowledged): an error, and
 * a copy of the file as it was is kept beside it, for whoever wants those commits back.
 * The copy is named after the WAL's last change and size
 * (convod.db-wal.damaged-YYYYMMDDTHHMMSSZ-BYTES), so that starts that fail again on the
 * same file keep it once, and only while it leaves at least as much free space as it takes.
 * The daemon goes on with what recovery keeps. Returns whether the frames recovery drops
 * may go (wal_forget_dropped): not when there is no copy. */
static bool wal_check(struct store *s)
{
	char wal[PATH_MAX], copy[PATH_MAX + 64], when[32];
	struct walcheck w;
	struct statvfs fs;
	bool no_room = false;
	struct stat st;
	struct tm tm;
	int fd, rc;

	if ((size_t)snprintf(wal, sizeof(wal), "%s-wal", s->real) >= sizeof(wal))
		return false; /* SQLite could not open it either */
	if ((fd = open(wal, O_RDONLY | O_CLOEXEC)) < 0) {
		if (errno != ENOENT)
			log_msg(LOG_WARN, "store", "cannot open %s to check it: %s", wal,
			        strerror(errno));
		return false;
	}
	if ((rc = walcheck_scan(fd, db_page_size(s->real), &w)) < 0)
		log_msg(LOG_WARN, "store", "cannot read %s to check it: %s", wal, strerror(-rc));
	if (rc < 0 || !w.lost_commits) {
		close(fd);
		return false;
	}
	s->wal_commits_dropped = (uint64_t)w.lost_commits;
	if (w.lost_commits == 1 && w.last_lost == w.last_own && !w.broken_commits) {
		log_msg(LOG_WARN, "store",
		        "%s: frame %" PRId64 " is not as it was written, and SQLite's recovery "
		        "drops the last commit of the file (frame %" PRId64
		        "), which it belongs to: a power loss while that commit was written "
		        "leaves this",
		        wal, w.first_bad, w.last_lost);
		close(fd);
		return true;
	}
	if (w.header_ok)
		log_msg(LOG_ERROR, "store",
		        "%s: SQLite's recovery stops at frame %" PRId64 " of %" PRId64
		        ", keeps the %" PRId64 " commits before it and drops %" PRId64
		        " later ones (up to frame %" PRId64 ") whose frames are intact",
		        wal, w.first_bad, w.frames, w.kept_commits, w.lost_commits, w.last_lost);
	else
		log_msg(LOG_ERROR, "store",
		        "%s: its header is not as SQLite wrote it, so SQLite's recovery ignores "
		        "the whole file (or refuses it), and drops %" PRId64 " commits (up to "
		        "frame %" PRId64 ") whose frames are intact",
		        wal, w.lost_commits, w.last_lost);
	log_msg(LOG_ERROR, "store",
	        "%s: the file was damaged after it was written, or a power loss kept later "
	        "writes and lost earlier ones (at durability machine, only writes not "
	        "acknowledged yet)",
	        wal);
	if (fstat(fd, &st) < 0) {
		rc = -errno;
	} else {
		gmtime_r(&st.st_mtime, &tm);
		strftime(when, sizeof(when), "%Y%m%dT%H%M%SZ", &tm);
		snprintf(copy, sizeof(copy), "%s.damaged-%s-%lld", wal, when,
		         (long long)st.st_size);
		/* A copy that fills the disk would leave the daemon nothing to write to (one
		 * kept by an earlier start takes its room already). */
		if (access(copy, F_OK) == 0)
			rc = -EEXIST;
		else if (fstatvfs(fd, &fs) == 0 &&
		         (uint64_t)fs.f_bavail * fs.f_frsize < 2 * (uint64_t)st.st_size)
			no_room = true;
		else
			rc = copy_synced(fd, copy);
	}
	if (no_room) {
		log_msg(
		    LOG_ERROR, "store",
		    "cannot keep a copy of %s: its %lld bytes would leave less than that free "
		    "(%llu bytes are); the WAL stays as it is, its dropped frames with it, until "
		    "the next commits write over them",
		    wal, (long long)st.st_size,
		    (unsigned long long)fs.f_bavail * (unsigned long long)fs.f_frsize);
		close(fd);
		return false;
	}
	close(fd);
	if (rc == 0 || rc == -EEXIST) {
		log_msg(LOG_ERROR, "store", "a copy of %s as it was is %s%s", wal, copy,
		        rc ? " (kept by an earlier start)" : "");
		return true;
	}
	log_msg(LOG_ERROR, "store",
	        "cannot keep a copy of %s: %s; the WAL stays as it is, its dropped frames with "
	        "it, until the next commits write over them",
	        wal, strerror(-rc));
	return false;
}

/* After a recovery that dropped whole commits (wal_check): the frames after those it kept
 * stay in the file, with this WAL's salts, where later commits write over only as far as
 * they reach; a crash then would show the rest as commits dropped again. A full checkpoint
 * that truncates the WAL (SQLite's, which knows what it kept) removes them. */
static void wal_forget_dropped(struct store *s)
{
	int busy = -1, frames = -1, done = -1;
	sqlite3_stmt *st = NULL;
	int rc = sqlite3_prepare_v2(s->db, "PRAGMA wal_checkpoint(TRUNCATE)", -1, &st, NULL);

	if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
		busy = sqlite3_column_int(st, 0);
		frames = sqlite3_column_int(st, 1);
		done = sqlite3_column_int(st, 2);
		rc = SQLITE_OK;
	}
	sqlite3_finalize(st);
	if (rc != SQLITE_OK || busy != 0)
		log_msg(LOG_WARN, "store",
		        "%s: cannot checkpoint and empty the WAL after its recovery dropped "
		        "commits (%s): the frames it dropped are still in it, and a crash "
		        "before the next checkpoint would show them as dropped again",
		        s->path, rc != SQLITE_OK ? sqlite3_errmsg(s->db) : "busy");
	else
		log_msg(LOG_INFO, "store",
		        "%s: after that recovery, the WAL was checkpointed (%d of %d frames) and "
		        "emptied",
		        s->path, done, frames);
}

int store_open(const char *dir, enum durability durability, struct store **out, char *errbuf,
               size_t errlen)
{
	struct store *s = NULL;
	struct stat sb;
	int64_t rows = 0;
	bool dropped;
	size_t n;
	int rc;

	*out = NULL;
	set_errbuf(errbuf, errlen, "%s", "");
	if (!dir || !*dir || durability > DURABILITY_MACHINE) {
		set_errbuf(errbuf, errlen, "store: no state directory given");
		return -EINVAL;
	}
	if (stat(dir, &sb) < 0) {
		rc = -errno;
		set_errbuf(errbuf, errlen, "state directory %s: %s", dir, strerror(-rc));
		return rc;
	}
	if (!S_ISDIR(sb.st_mode)) {
		set_errbuf(errbuf, errlen, "state directory %s is not a directory", dir);
		return -ENOTDIR;
	}
	/* SQLite would open the file read-only, or fail later creating the WAL beside it. */
	if (access(dir, W_OK | X_OK) < 0) {
		rc = -errno;
		set_errbuf(errbuf, errlen, "state directory %s is not writable: %s", dir,
		           strerror(-rc));
		return rc;
	}
	s = calloc(1, sizeof(*s));
	n = strlen(dir) + sizeof("/" STORE_FILE);
	if (!s || !(s->path = malloc(n))) {
		set_errbuf(errbuf, errlen, "store: out of memory");
		rc = -ENOMEM;
		goto fail;
	}
	snprintf(s->path, n, "%s/%s", dir, STORE_FILE);
	if (!(s->real = links_followed(s->path))) {
		set_errbuf(errbuf, errlen, "store: out of memory");
		rc = -ENOMEM;
		goto fail;
	}
	if ((rc = locks_init(s)) < 0) {
		set_errbuf(errbuf, errlen, "store: %s", strerror(-rc));
		goto fail;
	}
	if (getrandom(s->hash_key, sizeof(s->hash_key), 0) != sizeof(s->hash_key)) {
		/* Only the resistance to chosen ids depends on it. */
		s->hash_key[0] = (uint64_t)(uintptr_t)s ^ 0x9e3779b97f4a7c15ull;
		s->hash_key[1] = (uint64_t)time(NULL);
	}

	/* Before anything starts SQLite up (walvfs_register does): commits that rebalance a
	 * B-tree no longer scan the whole page cache as they end. Where something else started
	 * SQLite first, its own cache stays: slower, not wrong. */
	pagecache_install();
	/* The loop's commits write their WAL frames through walvfs, one write each. */
	if ((rc = walvfs_register()) < 0) {
		set_errbuf(errbuf, errlen, "store: cannot register its SQLite VFS: %s",
		           strerror(-rc));
		goto fail;
	}
	walvfs_counts(&s->syncs_at_open);
	dropped = wal_check(s);
	/* At machine a commit whose sync fails is spoiled in the WAL too (walvfs.h). */
	rc = sqlite3_open_v2(s->path, &s->db,
	                     SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX |
	                         SQLITE_OPEN_EXRESCODE,
	                     durability == DURABILITY_MACHINE ? WALVFS_SYNCED_NAME : WALVFS_NAME);
	if (rc != SQLITE_OK) {
		int e = s->db ? sqlite3_system_errno(s->db) : 0;
		set_errbuf(errbuf, errlen, "cannot open %s: %s%s%s", s->path,
		           s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc), e ? ": " : "",
		           e ? strerror(e) : "");
		rc = e ? -e : errno_of(s->db, rc);
		goto fail;
	}
	sqlite3_busy_timeout(s->db, STORE_BUSY_TIMEOUT_MS);
	s->durability = durability;
	s->fold_records = STORE_FOLD_RECORDS;
	s->checkpoint_pages = STORE_CHECKPOINT_PAGES;
	s->wal_hard_pages = STORE_WAL_HARD_PAGES;
	s->cohort_wait_ns = STORE_COHORT_WAIT_NS;
	s->writeback_pages = STORE_WAL_WRITEBACK_PAGES;
	s->ck.catch_up_pages = STORE_CATCH_UP_PAGES;
	if ((rc = open_checks(s, durability, errbuf, errlen)) < 0)
		goto fail;
	if (dropped)
		wal_forget_dropped(s);
	/* Pages the loop reads again (the conversations' index, the spool) stay in memory. */
	sqlite3_exec(s->db, "PRAGMA cache_size=-32768", NULL, NULL, NULL);
	if (query_one(s->db, "SELECT EXISTS(SELECT 1 FROM dead_letters)", &rows, NULL, 0) !=
	        SQLITE_OK ||
	    rows)
		s->sink_rows = s->dead_rows = true;
	if (query_one(s->db,
	              "SELECT EXISTS(SELECT 1 FROM spool) OR EXISTS(SELECT 1 FROM confirmed)",
	              &rows, NULL, 0) != SQLITE_OK ||
	    rows)
		s->sink_rows = true;
	/* What a crash left in the journal is folded before anything is read; on a full disk
	 * it stays pending in memory (reads merge it) until the fold can be written. */
	if ((rc = replay_batches(s)) < 0) {
		set_errbuf(errbuf, errlen, "%s: cannot read the journal: %s", s->path,
		           strerror(-rc));
		goto fail;
	}
	if ((rc = settle(s)) == -ENOSPC) {
		log_msg(LOG_WARN, "store",
		        "%s: the disk is full: the journal a crash left stays unfolded (in memory) "
		        "until there is room",
		        s->path);
	} else if (rc < 0) {
		set_errbuf(errbuf, errlen, "%s: cannot fold the journal a crash left: %s", s->path,
		           strerror(-rc));
		goto fail;
	}
	if ((rc = checkpointer_start(s, durability)) < 0 || (rc = writer_start(s)) < 0) {
		set_errbuf(errbuf, errlen, "store: cannot start a thread: %s", strerror(-rc));
		goto fail;
	}
	*out = s;
	return 0;
fail:
	store_close(s);
	return rc;
}

void store_close(struct store *s)
{
	if (!s)
		return;
	store_rollback(s);
	writer_stop(s); /* after what it was given */
	/* The next start then finds no journal to fold. */
	if (s->st[ST_BATCH_PUT])
		settle(s);
	checkpointer_stop(s);
	for (int i = 0; i < ST_COUNT; i++)
		sqlite3_finalize(s->st[i]);
	if (s->db && sqlite3_close(s->db) != SQLITE_OK)
		log_msg(LOG_ERROR, "store", "%s: close: %s", s->path, sqlite3_errmsg(s->db));
	pending_free(&s->cur);
	pending_free(&s->next);
	buf_free(&s->packed);
	buf_free(&s->batch);
	buf_free(&s->ops);
	if (s->locks_ready) {
		pthread_cond_destroy(&s->qcv);
		pthread_mutex_destroy(&s->dbmu);
		pthread_mutex_destroy(&s->qmu);
	}
	free(s->path);
	free(s->real);
	free(s);
}

static int size_limit(struct store *s, uint64_t max_bytes)
{
	int64_t page_size = 0, pages;
	char sql[64];
	int rc = query_one(s->db, "PRAGMA page_size", &page_size, NULL, 0);
	if (rc != SQLITE_OK || page_size <= 0)
		return fail(s, NULL, rc);
	/* SQLite clamps a count above its compile-time maximum to that maximum. */
	pages = max_bytes ? (int64_t)(max_bytes / (uint64_t)page_size) : INT64_C(4294967294);
	snprintf(sql, sizeof(sql), "PRAGMA max_page_count=%" PRId64, pages ? pages : 1);
	rc = query_one(s->db, sql, NULL, NULL, 0);
	return rc == SQLITE_OK ? 0 : fail(s, NULL, rc);
}

int store_set_size_limit(struct store *s, uint64_t max_bytes)
{
	pthread_mutex_lock(&s->dbmu);
	int rc = size_limit(s, max_bytes);
	pthread_mutex_unlock(&s->dbmu);
	return rc;
}

/* ---- transactions (the loop's side) ---- */

void store_set_fold_records(struct store *s, size_t n)
{
	pthread_mutex_lock(&s->dbmu);
	s->fold_records = n ? n : 1;
	pthread_mutex_unlock(&s->dbmu);
}

unsigned store_fail_sync_full(struct store *s, bool fail)
{
	unsigned n;

	pthread_mutex_lock(&s->dbmu);
	s->fail_sync_full = fail;
	n = s->sync_full_failures;
	s->sync_full_failures = 0;
	pthread_mutex_unlock(&s->dbmu);
	return n;
}

void store_set_idle_fold(struct store *s, bool on)
{
	pthread_mutex_lock(&s->qmu);
	s->no_idle_fold = !on;
	pthread_mutex_unlock(&s->qmu);
}

void store_set_wal_writeback(struct store *s, int pages)
{
	/* wal_hook reads it in commits, which hold dbmu */
	pthread_mutex_lock(&s->dbmu);
	s->writeback_pages = pages;
	pthread_mutex_unlock(&s->dbmu);
}

void store_set_cohort_wait(struct store *s, uint64_t ns)
{
	pthread_mutex_lock(&s->qmu);
	s->cohort_wait_ns = ns;
	pthread_mutex_unlock(&s->qmu);
}

void store_hold_checkpoints(struct store *s, bool hold)
{
	pthread_mutex_lock(&s->ck.mu);
	s->ck.held = hold;
	pthread_cond_signal(&s->ck.cv);
	pthread_mutex_unlock(&s->ck.mu);
}

void store_set_wal_pages(struct store *s, int checkpoint, int hard, int catch_up)
{
	/* wal_hook reads them in commits, which hold dbmu */
	pthread_mutex_lock(&s->dbmu);
	s->checkpoint_pages = checkpoint > 0 ? checkpoint : 1;
	s->wal_hard_pages = hard > s->checkpoint_pages ? hard : s->checkpoint_pages;
	pthread_mutex_unlock(&s->dbmu);
	if (catch_up > 0)
		atomic_store_explicit(&s->ck.catch_up_pages, catch_up, memory_order_relaxed);
}

int store_begin(struct store *s)
{
	if (s->in_txn)
		return -EINVAL;
	s->in_txn = true;
	s->txn_err = 0;
	s->txn_repairs = 0;
	s->batch.len = 0;
	s->batch_records = 0;
	s->ops.len = 0;
	return 0;
}

void store_rollback(struct store *s)
{
	if (!s->in_txn)
		return;
	s->in_txn = false;
	s->txn_err = 0;
	s->batch.len = 0;
	s->batch_records = 0;
	s->ops.len = 0;
	if (s->batch.cap > STORE_BUF_KEEP)
		buf_free(&s->batch);
	if (s->ops.cap > STORE_BUF_KEEP)
		buf_free(&s->ops);
}

/* The open transaction as a job (its buffers handed over), or NULL (ENOMEM). */
static struct job *take_transaction(struct store *s)
{
	struct job *j = calloc(1, sizeof(*j));

	if (!j)
		return NULL;
	j->kind = JOB_WRITE;
	if (s->batch.len) {
		j->recs = buf_steal(&s->batch, &j->recs_len);
		j->nrecs = s->batch_records;
	}
	if (s->ops.len)
		j->ops = buf_steal(&s->ops, &j->ops_len);
	s->in_txn = false;
	s->batch.len = 0;
	s->batch_records = 0;
	s->ops.len = 0;
	return j;
}

/* The open transaction as a job, for store_submit and store_commit; when it cannot be,
 * it is rolled back and the error returned. */
static int take_open(struct store *s, struct job **out)
{
	int rc;

	*out = NULL;
	if (!s->in_txn)
		return -EINVAL;
	if (s->txn_err) {
		rc = s->txn_err;
		store_rollback(s);
		return rc;
	}
	if (!(*out = take_transaction(s))) {
		store_rollback(s);
		return -ENOMEM;
	}
	return 0;
}

int store_submit(struct store *s, uint64_t *seq)
{
	struct job *j;
	int rc;

	*seq = 0;
	if ((rc = take_open(s, &j)) < 0)
		return rc;
	/* At durability process a commit is a few writes to the page cache: the loop writes it
	 * itself when the writer has nothing under way, sparing two thread wake-ups. */
	pthread_mutex_lock(&s->qmu);
	if (s->durability != DURABILITY_MACHINE && j->nrecs <= STORE_INLINE_RECORDS &&
	    !s->busy && !s->queue && !s->failed && !s->wal_full &&
	    pthread_mutex_trylock(&s->dbmu) == 0) {
		/* Not while the writer holds the connection (a fold step, a checkpoint): the
		 * loop does not wait, it hands over. */
		j->seq = ++s->submitted;
		s->busy = true;
		pthread_mutex_unlock(&s->qmu);
		rc = write_jobs(s, j);
		pthread_mutex_unlock(&s->dbmu);
		count_add(&s->n.inline_commits, rc == 0);
		pthread_mutex_lock(&s->qmu);
		s->busy = false;
		if (!rc)
			s->committed = j->seq;
		else {
			s->failed = true;
			s->fail_error = rc;
		}
		/* No broadcast: qcv's waiters are the writer, which has nothing to do with a
		 * commit it did not write, and job_run_sync, which runs on this thread (the
		 * store has one caller). Broadcasting woke the idle writer for nothing after
		 * every inline commit: 6,000 futile wake-ups a second at 50 connections. */
		pthread_mutex_unlock(&s->qmu);
		*seq = j->seq;
		job_free(j);
		return 0;
	}
	pthread_mutex_unlock(&s->qmu);
	*seq = job_queue(s, j);
	return 0;
}

int store_commit(struct store *s)
{
	struct job *j;
	int rc;

	if ((rc = take_open(s, &j)) < 0)
		return rc;
	rc = job_run_sync(s, j);
	job_free(j);
	if (rc < 0) {
		/* Nobody else reverts anything for a caller that waits: start over. */
		store_failure_ack(s);
		return rc == -ECANCELED ? -EIO : rc;
	}
	return 0;
}

int store_sync(struct store *s)
{
	struct job *j = calloc(1, sizeof(*j));
	int rc;

	if (!j)
		return -ENOMEM;
	j->kind = JOB_WRITE; /* an empty write: done once everything before it is */
	rc = job_run_sync(s, j);
	job_free(j);
	return rc == -ECANCELED ? -EIO : rc;
}

/* ---- writes ---- */

int store_put_message(struct store *s, const char *conv, size_t conv_len, const struct message *m)
{
	char sk[MESSAGE_SK_MAX + 1];
	struct msgrec r;
	int rc = write_check(s);

	if (rc)
		return rc;
	/* A summary's key needs the last id it summarizes (see ddbitem_sort_key). */
	if (!conv || !m || !m->version || (m->role == ROLE_SUMMARY && !m->nsummary_ids))
		return -EINVAL;
	message_sort_key(m, sk);
	s->packed.len = 0;
	if ((rc = message_pack(&s->packed, m)) < 0)
		goto out;
	r.conv = conv;
	r.conv_len = conv_len;
	r.sk = sk;
	r.sk_len = strlen(sk);
	r.version = m->version;
	r.client_seen = m->seen[CONSUMER_CLIENT];
	r.updated_ms = m->updated_ms;
	r.map = s->packed.data;
	r.map_len = s->packed.len;
	r.packed = true;
	if ((rc = msgrec_append(&s->batch, &r)) == 0)
		s->batch_records++;
out:
	if (s->packed.cap > STORE_BUF_KEEP)
		buf_free(&s->packed);
	s->packed.len = 0;
	return write_done(s, rc);
}

/* Records op o in the open transaction. */
static int write_op(struct store *s, const struct store_op *o)
{
	int rc = write_check(s);
	if (rc)
		return rc;
	if (!o->conv || o->conv_len > UINT32_MAX - 1)
		return -EINVAL;
	return write_done(s, op_record(s, o));
}

int store_put_conversation(struct store *s, const struct convo *c)
{
	struct store_op o = {OPK_PUT_CONVERSATION, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0, 0, 0};
	if (!c || !c->id)
		return write_check(s) ? write_check(s) : -EINVAL;
	o.conv = c->id;
	o.conv_len = c->id_len;
	o.when = c->updated_ms;
	return write_op(s, &o);
}

int store_set_closed(struct store *s, const char *conv, size_t conv_len, int64_t closed_ms)
{
	struct store_op o = {OPK_SET_CLOSED, conv, NULL, NULL, NULL, conv_len, 0, 0, 0, 0, 0, 0};
	o.when = closed_ms < 1 ? 1 : closed_ms;
	return write_op(s, &o);
}

int store_spool_put(struct store *s, const char *conv, size_t conv_len, const char *sk,
                    uint32_t version, size_t map_bytes, int64_t now_ms)
{
	struct store_op o = {OPK_SPOOL_PUT, conv, sk,    NULL, NULL, conv_len, 0, 0, 0,
	                     version,       0,    now_ms};
	if (!sk)
		return write_check(s) ? write_check(s) : -EINVAL;
	o.sk_len = strlen(sk);
	o.map_bytes = map_bytes;
	s->sink_rows = true;
	return write_op(s, &o);
}

int store_spool_done(struct store *s, const char *conv, size_t conv_len, const char *sk,
                     uint32_t version)
{
	struct store_op o = {OPK_SPOOL_DONE, conv, sk, NULL, NULL, conv_len, 0, 0, 0,
	                     version,        0,    0};
	if (!sk)
		return write_check(s) ? write_check(s) : -EINVAL;
	o.sk_len = strlen(sk);
	s->sink_rows = true;
	return write_op(s, &o);
}

int store_dead_letter(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version, const char *item_json, const char *error, int64_t now_ms)
{
	struct store_op o = {
	    OPK_DEAD_LETTER, conv, sk,    item_json, error ? error : "", conv_len, 0, 0, 0,
	    version,         0,    now_ms};
	if (!sk)
		return write_check(s) ? write_check(s) : -EINVAL;
	o.sk_len = strlen(sk);
	o.item_len = item_json ? strlen(item_json) : 0;
	o.error_len = strlen(o.error);
	s->sink_rows = s->dead_rows = true;
	return write_op(s, &o);
}

static int repair_op(struct store *s, enum op_kind kind, const char *conv, size_t conv_len,
                     const char *sk, uint32_t version, int64_t due_ms)
{
	struct store_op o = {kind, conv, sk, NULL, NULL, conv_len, 0, 0, 0, version, 0, due_ms};
	if (!sk)
		return write_check(s) ? write_check(s) : -EINVAL;
	o.sk_len = strlen(sk);
	return write_op(s, &o);
}

int store_repair_put(struct store *s, const char *conv, size_t conv_len, const char *sk,
                     uint32_t version, int64_t due_ms)
{
	int rc = repair_op(s, OPK_REPAIR_PUT, conv, conv_len, sk, version, due_ms);
	if (rc == 0)
		s->txn_repairs++;
	return rc;
}

int store_repair_done(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version)
{
	return repair_op(s, OPK_REPAIR_DONE, conv, conv_len, sk, version, 0);
}

/* ---- reads ---- */

/* Logs a row that cannot be read back and returns -EIO. */
static int bad_row(struct store *s, const char *conv, size_t conv_len, const char *sk,
                   size_t sk_len, const char *what)
{
	log_msg(LOG_ERROR, "store", "%s: conversation \"%.*s\"%s%.*s: %s", s->path,
	        (int)(conv_len > 200 ? 200 : conv_len), conv, sk ? " message " : "",
	        (int)(sk ? sk_len : 0), sk ? sk : "", what);
	return -EIO;
}

/* The version of (conv, sk) that a one-integer statement finds, or 0. */
static int64_t key_version(struct store *s, enum stmt_id id, const char *conv, size_t conv_len,
                           const struct msgrec *r)
{
	sqlite3_stmt *st = s->st[id];
	int64_t v = 0;

	if (bind_conv(st, 1, conv, conv_len) == SQLITE_OK &&
	    sqlite3_bind_text64(st, 2, r->sk, r->sk_len, SQLITE_STATIC, SQLITE_UTF8) == SQLITE_OK &&
	    sqlite3_step(st) == SQLITE_ROW)
		v = sqlite3_column_int64(st, 0);
	sqlite3_reset(st);
	return v;
}

/* The message of record r (packed or JSON), with its version and update time; seen[] is
 * 0. The record's sort key must be the message's. -EIO for a damaged record (logged);
 * -ENOMEM, not logged, when there was no memory to decode it (the decoders' ERR_INTERNAL,
 * jansson's out of memory): the row is sound. */
static int record_decode(struct store *s, const char *conv, size_t conv_len,
                         const struct msgrec *r, struct message **out)
{
	char key[MESSAGE_SK_MAX + 1];
	struct message *m = NULL;
	struct error e;
	enum error_code code;
	json_error_t je;
	json_t *map = NULL;
	int rc = 0;

	*out = NULL;
	if (r->version < 1 || r->client_seen > r->version) {
		rc = bad_row(s, conv, conv_len, r->sk, r->sk_len, "version out of range");
		goto out;
	}
	if (r->packed) {
		/* The id is the sort key's end (see message_sort_key). */
		const char *id = r->sk_len < ULID_LEN ? NULL : r->sk + r->sk_len - ULID_LEN;
		if (!id || !ulid_valid(id, ULID_LEN)) {
			rc = bad_row(s, conv, conv_len, r->sk, r->sk_len, "bad sort key");
			goto out;
		}
		if ((code = message_unpack(r->map, r->map_len, id, r->version, &m, &e)) != ERR_OK) {
			rc = code == ERR_INTERNAL
			         ? -ENOMEM
			         : bad_row(s, conv, conv_len, r->sk, r->sk_len, e.message);
			goto out;
		}
	} else {
		/* ops_json_loadb: jansson out of memory may drop a byte of a string and still
		 * return a document. */
		bool no_memory = false;
		if (!(map = ops_json_loadb(r->map, r->map_len, JSON_ALLOW_NUL, &je, &no_memory))) {
			rc = no_memory || json_error_code(&je) == json_error_out_of_memory
			         ? -ENOMEM
			         : bad_row(s, conv, conv_len, r->sk, r->sk_len, je.text);
			goto out;
		}
		if ((code = message_from_map(map, r->version, &m, &e)) != ERR_OK) {
			rc = code == ERR_INTERNAL
			         ? -ENOMEM
			         : bad_row(s, conv, conv_len, r->sk, r->sk_len, e.message);
			goto out;
		}
	}
	/* store_put_message keys a summary by the last id it summarizes: one without any
	 * was never written. */
	message_sort_key(m, key);
	if ((m->role == ROLE_SUMMARY && !m->nsummary_ids) || strlen(key) != r->sk_len ||
	    memcmp(key, r->sk, r->sk_len) != 0) {
		rc = bad_row(s, conv, conv_len, r->sk, r->sk_len,
		             "sort key does not match the message");
		goto out;
	}
	m->updated_ms = r->updated_ms;
	*out = m;
	m = NULL;
out:
	message_free(m);
	json_decref(map);
	return rc;
}

/* The message of record r of conversation c. */
static int record_message(struct store *s, const struct convo *c, const struct msgrec *r,
                          struct message **out)
{
	struct message *m;
	int rc;

	if ((rc = record_decode(s, c->id, c->id_len, r, out)) < 0)
		return rc;
	m = *out;
	m->seen[CONSUMER_STORE] = r->version;
	/* Taken by the sink only when confirmed, spooled or dead-lettered at this version: a
	 * version whose spool row was never committed is taken again, while a dead letter
	 * waits for retry_dead_letters (DynamoDB would refuse it again). */
	if (s->sink_rows) {
		int64_t covered = key_version(s, ST_CONFIRMED_VERSION, c->id, c->id_len, r);
		int64_t spooled = key_version(s, ST_SPOOL_VERSION, c->id, c->id_len, r);
		int64_t dead =
		    s->dead_rows ? key_version(s, ST_DEAD_VERSION, c->id, c->id_len, r) : 0;
		if (spooled > covered)
			covered = spooled;
		if (dead > covered)
			covered = dead;
		m->seen[CONSUMER_SINK] = covered >= r->version ? r->version : (uint32_t)covered;
	}
	m->seen[CONSUMER_CLIENT] = r->client_seen;
	return 0;
}

/* Candidates for one conversation's messages: its segments' records (read into segs), then
 * its pending records, in that order. */
struct cands {
	struct cand *v;
	size_t n, cap;
};

static int cands_push(struct cands *c, const struct msgrec *r)
{
	if (c->n == c->cap) {
		size_t ncap = c->cap ? 2 * c->cap : 64;
		struct cand *p = realloc(c->v, ncap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		c->v = p;
		c->cap = ncap;
	}
	c->v[c->n].r = *r;
	c->v[c->n].order = c->n;
	c->n++;
	return 0;
}

static int pending_collect(const struct pending *p, const char *conv, size_t conv_len,
                           uint64_t hash, struct cands *out)
{
	const struct pconv *c = pending_conv(p, conv, conv_len, hash);

	for (size_t e = c ? c->first : SIZE_MAX; e != SIZE_MAX; e = p->entries[e].next) {
		struct msgrec r;
		size_t pos = 0;
		msgrec_next(p->entries[e].rec, SIZE_MAX - (uintptr_t)p->entries[e].rec, &pos, &r);
		if (cands_push(out, &r) < 0)
			return -ENOMEM;
	}
	return 0;
}

static int collect_records(struct store *s, const char *conv, size_t conv_len, struct buf *segs,
                           struct cands *out)
{
	sqlite3_stmt *st = s->st[ST_SEGMENTS_OF];
	uint64_t hash = siphash13(s->hash_key, (const unsigned char *)conv, conv_len);
	struct msgrec r;
	size_t pos = 0;
	int rc = 0, step, got;

	if ((rc = bind_conv(st, 1, conv, conv_len)) != SQLITE_OK)
		return fail(s, st, rc);
	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		const void *data = sqlite3_column_blob(st, 0);
		size_t len = (size_t)sqlite3_column_bytes(st, 0);
		if (len && buf_append(segs, data, len) < 0) {
			rc = -ENOMEM;
			break;
		}
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	if (rc)
		return rc;
	while ((got = msgrec_next(segs->data, segs->len, &pos, &r)) == 1)
		if (cands_push(out, &r) < 0)
			return -ENOMEM;
	if (got < 0)
		return bad_row(s, conv, conv_len, NULL, 0, "a damaged segment");
	if ((rc = pending_collect(&s->cur, conv, conv_len, hash, out)) < 0 ||
	    (rc = pending_collect(&s->next, conv, conv_len, hash, out)) < 0)
		return rc;
	return 0;
}

/* Rebuilds conversation conv (whose row has updated time updated) from its records. */
static int load_one(struct store *s, const char *conv, size_t conv_len, int64_t updated,
                    struct convo **out)
{
	struct buf segs = {NULL, 0, 0};
	struct cands cands = {NULL, 0, 0};
	struct convo *c = NULL;
	struct message *m;
	struct error e;
	size_t n;
	int rc;

	*out = NULL;
	if (!(c = convo_new(conv_len ? conv : "", conv_len))) {
		rc = -ENOMEM;
		goto out;
	}
	if ((rc = collect_records(s, conv, conv_len, &segs, &cands)) < 0)
		goto out;
	n = newest_per_key(cands.v, cands.n);
	for (size_t i = 0; i < n; i++) {
		if ((rc = record_message(s, c, &cands.v[i].r, &m)) < 0)
			goto out;
		if ((rc = convo_restore_append(c, m)) < 0)
			goto out;
	}
	if (convo_restore_finish(c, &e) != ERR_OK) {
		rc = bad_row(s, c->id, c->id_len, NULL, 0, e.message);
		goto out;
	}
	if (updated > c->updated_ms)
		c->updated_ms = updated;
	*out = c;
	c = NULL;
out:
	convo_free(c);
	buf_free(&segs);
	free(cands.v);
	return rc;
}

static int load_conversation(struct store *s, const char *conv, size_t conv_len, struct convo **out)
{
	sqlite3_stmt *st = s->st[ST_CONVERSATION_GET];
	int64_t updated = 0;
	int rc, step;

	*out = NULL;
	if (!conv)
		return -EINVAL;
	if ((rc = bind_conv(st, 1, conv, conv_len)) != SQLITE_OK)
		return fail(s, st, rc);
	step = sqlite3_step(st);
	if (step == SQLITE_ROW)
		updated = sqlite3_column_int64(st, 0);
	rc = step == SQLITE_ROW ? 0 : step == SQLITE_DONE ? -ENOENT : fail(s, st, step);
	sqlite3_reset(st);
	if (rc)
		return rc;
	return load_one(s, conv, conv_len, updated, out);
}

static int load_open(struct store *s, bool (*skip)(void *arg, const char *id, size_t len),
                     int (*fn)(void *arg, struct convo *c), void *arg)
{
	sqlite3_stmt *st = s->st[ST_OPEN_EACH];
	struct buf id = {NULL, 0, 0};
	struct convo *c;
	int rc = 0, step;

	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		const void *p = sqlite3_column_blob(st, 0);
		size_t len = (size_t)sqlite3_column_bytes(st, 0);
		if (skip && skip(arg, len ? p : "", len))
			continue;
		id.len = 0;
		/* The id is copied: loading runs other statements while this one walks. */
		if (buf_append(&id, len ? p : "", len ? len : 1) < 0) {
			rc = -ENOMEM;
			break;
		}
		if ((rc = load_conversation(s, id.data, len, &c)) < 0)
			break;
		if ((rc = fn(arg, c)) != 0)
			break;
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	buf_free(&id);
	return rc;
}

static int spool_each(struct store *s, int64_t after_seq,
                      int (*fn)(void *arg, int64_t seq, const char *conv, size_t conv_len,
                                const char *sk, uint32_t version, int64_t enqueued_ms),
                      void *arg)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_EACH];
	int rc = 0, step;

	if ((step = sqlite3_bind_int64(st, 1, after_seq)) != SQLITE_OK)
		return fail(s, st, step);
	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		const char *conv = sqlite3_column_blob(st, 1);
		size_t conv_len = (size_t)sqlite3_column_bytes(st, 1);
		const char *sk = (const char *)sqlite3_column_text(st, 2);
		int64_t version = sqlite3_column_int64(st, 3);
		if (!sk || version < 0 || version > UINT32_MAX) {
			rc = bad_row(s, conv ? conv : "", conv_len, sk, sk ? strlen(sk) : 0,
			             "bad spool row");
			break;
		}
		if ((rc = fn(arg, sqlite3_column_int64(st, 0), conv ? conv : "", conv_len, sk,
		             (uint32_t)version, sqlite3_column_int64(st, 4))) != 0)
			break;
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

static int repair_each(struct store *s,
                       int (*fn)(void *arg, const char *conv, size_t conv_len, const char *sk,
                                 uint32_t version, int64_t due_ms),
                       void *arg)
{
	sqlite3_stmt *st = s->st[ST_REPAIR_EACH];
	int rc = 0, step;

	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		const char *conv = sqlite3_column_blob(st, 0);
		size_t conv_len = (size_t)sqlite3_column_bytes(st, 0);
		const char *sk = (const char *)sqlite3_column_text(st, 1);
		int64_t version = sqlite3_column_int64(st, 2);
		if (!conv || !sk || version < 1 || version > UINT32_MAX) {
			rc = bad_row(s, conv ? conv : "", conv_len, sk, sk ? strlen(sk) : 0,
			             "bad repairs row");
			break;
		}
		if ((rc = fn(arg, conv, conv_len, sk, (uint32_t)version,
		             sqlite3_column_int64(st, 3))) != 0)
			break;
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

/* The newest record of (conv, sk) among pending ones: the last in its chain. */
static bool pending_find(const struct pending *p, const char *conv, size_t conv_len,
                         uint64_t hash, const char *sk, size_t sk_len, struct msgrec *out)
{
	const struct pconv *c = pending_conv(p, conv, conv_len, hash);
	bool found = false;

	for (size_t e = c ? c->first : SIZE_MAX; e != SIZE_MAX; e = p->entries[e].next) {
		struct msgrec r;
		size_t pos = 0;
		msgrec_next(p->entries[e].rec, SIZE_MAX - (uintptr_t)p->entries[e].rec, &pos, &r);
		if (r.sk_len == sk_len && memcmp(r.sk, sk, sk_len) == 0) {
			*out = r;
			found = true;
		}
	}
	return found;
}

/* The map of record r as the caller's new JSON value. */
static int record_map(struct store *s, const char *conv, size_t conv_len, const struct msgrec *r,
                      json_t **map, uint32_t *version, int64_t *updated_ms)
{
	struct message *m;
	int rc;

	if ((rc = record_decode(s, conv, conv_len, r, &m)) < 0)
		return rc;
	*map = message_to_map(m);
	message_free(m);
	if (!*map)
		return -ENOMEM;
	*version = r->version;
	*updated_ms = r->updated_ms;
	return 0;
}

static int message_get(struct store *s, const char *conv, size_t conv_len, const char *sk,
                       json_t **map, uint32_t *version, int64_t *updated_ms)
{
	sqlite3_stmt *st = s->st[ST_SEGMENTS_NEWEST];
	uint64_t hash;
	struct msgrec r;
	size_t sk_len;
	int rc, step;

	*map = NULL;
	if (!conv || !sk)
		return -EINVAL;
	hash = siphash13(s->hash_key, (const unsigned char *)conv, conv_len);
	sk_len = strlen(sk);
	if (pending_find(&s->next, conv, conv_len, hash, sk, sk_len, &r) ||
	    pending_find(&s->cur, conv, conv_len, hash, sk, sk_len, &r))
		return record_map(s, conv, conv_len, &r, map, version, updated_ms);
	/* The newest segment holding the message has its newest version. */
	if ((rc = bind_conv(st, 1, conv, conv_len)) != SQLITE_OK)
		return fail(s, st, rc);
	rc = -ENOENT;
	while (rc == -ENOENT && (step = sqlite3_step(st)) == SQLITE_ROW) {
		const char *data = sqlite3_column_blob(st, 0);
		size_t len = (size_t)sqlite3_column_bytes(st, 0), pos = 0;
		int got;
		while ((got = msgrec_next(data, len, &pos, &r)) == 1) {
			if (r.sk_len == sk_len && memcmp(r.sk, sk, sk_len) == 0) {
				rc = record_map(s, conv, conv_len, &r, map, version, updated_ms);
				break;
			}
		}
		if (got < 0)
			rc = bad_row(s, conv, conv_len, NULL, 0, "a damaged segment");
	}
	if (rc == -ENOENT && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

/* The three integers of the one row statement st (bound) answers, then reset. 0 or -errno
 * (logged). */
static int row_of_three(struct store *s, sqlite3_stmt *st, int64_t v[3])
{
	int rc = 0, step = sqlite3_step(st);

	if (step == SQLITE_ROW)
		for (int i = 0; i < 3; i++)
			v[i] = sqlite3_column_int64(st, i);
	else
		rc = fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

static int spool_stats(struct store *s, uint64_t *items, uint64_t *bytes, int64_t *oldest_ms)
{
	int64_t v[3];
	int rc = row_of_three(s, s->st[ST_SPOOL_STATS], v);

	if (rc == 0) {
		*items = (uint64_t)v[0];
		*bytes = (uint64_t)v[1];
		*oldest_ms = v[2];
	}
	return rc;
}

static int spool_bytes(struct store *s, int64_t after_seq, size_t limit, size_t *rows,
                       uint64_t *bytes, int64_t *last_seq)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_BYTES];
	int64_t v[3];
	int rc;

	if ((rc = sqlite3_bind_int64(st, 1, after_seq)) != SQLITE_OK ||
	    (rc = sqlite3_bind_int64(st, 2, limit > INT64_MAX ? INT64_MAX : (int64_t)limit)) !=
	        SQLITE_OK)
		return fail(s, st, rc);
	if ((rc = row_of_three(s, st, v)) == 0) {
		*rows = (size_t)v[0];
		*bytes = (uint64_t)v[1];
		*last_seq = v[2];
	}
	return rc;
}

/* One dead letter of ST_DEAD_LIST as an object. NULL on ENOMEM or a bad row. */
static json_t *dead_letter_json(sqlite3_stmt *st)
{
	const char *conv = sqlite3_column_blob(st, 0);
	const char *sk = (const char *)sqlite3_column_text(st, 1);
	const char *error = (const char *)sqlite3_column_text(st, 3);
	json_t *o = json_object();
	if (!o || !sk || !error ||
	    json_object_set_new(
	        o, "conversation",
	        json_stringn(conv ? conv : "", (size_t)sqlite3_column_bytes(st, 0))) < 0 ||
	    json_object_set_new(o, "sk", json_string(sk)) < 0 ||
	    json_object_set_new(o, "version", json_integer(sqlite3_column_int64(st, 2))) < 0 ||
	    json_object_set_new(o, "error", json_string(error)) < 0 ||
	    json_object_set_new(o, "at", json_integer(sqlite3_column_int64(st, 4))) < 0) {
		json_decref(o);
		return NULL;
	}
	return o;
}

static int dead_letters(struct store *s, size_t limit, json_t **out)
{
	sqlite3_stmt *st = s->st[ST_DEAD_LIST];
	json_t *arr = NULL;
	int rc = 0, step;

	*out = NULL;
	if (!(arr = json_array()))
		return -ENOMEM;
	if ((rc = sqlite3_bind_int64(st, 1, limit > INT64_MAX ? INT64_MAX : (int64_t)limit)) !=
	    SQLITE_OK) {
		rc = fail(s, st, rc);
		goto out;
	}
	rc = 0;
	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		json_t *o = dead_letter_json(st);
		if (!o || json_array_append_new(arr, o) < 0) {
			rc = -ENOMEM;
			goto out;
		}
	}
	if (step != SQLITE_DONE) {
		rc = fail(s, st, step);
		goto out;
	}
	*out = arr;
	arr = NULL;
out:
	sqlite3_reset(st);
	json_decref(arr);
	return rc;
}

/* The reads of store.h: what is committed, between two of the writer's transactions. */
#define LOCKED(s, call)                                                                    \
	do {                                                                               \
		pthread_mutex_lock(&(s)->dbmu);                                            \
		int locked_rc_ = (call);                                                   \
		pthread_mutex_unlock(&(s)->dbmu);                                          \
		return locked_rc_;                                                         \
	} while (0)

int store_load_conversation(struct store *s, const char *conv, size_t conv_len, struct convo **out)
{
	LOCKED(s, load_conversation(s, conv, conv_len, out));
}

int store_load_open(struct store *s, int (*fn)(void *arg, struct convo *c), void *arg)
{
	LOCKED(s, load_open(s, NULL, fn, arg));
}

int store_load_open_except(struct store *s, bool (*skip)(void *arg, const char *id, size_t len),
                           int (*fn)(void *arg, struct convo *c), void *arg)
{
	LOCKED(s, load_open(s, skip, fn, arg));
}

int store_spool_each(struct store *s, int64_t after_seq,
                     int (*fn)(void *arg, int64_t seq, const char *conv, size_t conv_len,
                               const char *sk, uint32_t version, int64_t enqueued_ms),
                     void *arg)
{
	LOCKED(s, spool_each(s, after_seq, fn, arg));
}

int store_repair_each(struct store *s,
                      int (*fn)(void *arg, const char *conv, size_t conv_len, const char *sk,
                                uint32_t version, int64_t due_ms),
                      void *arg)
{
	LOCKED(s, repair_each(s, fn, arg));
}

int store_message_get(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      json_t **map, uint32_t *version, int64_t *updated_ms)
{
	LOCKED(s, message_get(s, conv, conv_len, sk, map, version, updated_ms));
}

int store_spool_stats(struct store *s, uint64_t *items, uint64_t *bytes, int64_t *oldest_ms)
{
	LOCKED(s, spool_stats(s, items, bytes, oldest_ms));
}

int store_spool_bytes(struct store *s, int64_t after_seq, size_t limit, size_t *rows,
                      uint64_t *bytes, int64_t *last_seq)
{
	LOCKED(s, spool_bytes(s, after_seq, limit, rows, bytes, last_seq));
}

int store_dead_letters(struct store *s, size_t limit, json_t **out)
{
	LOCKED(s, dead_letters(s, limit, out));
}

/* ---- what the writer runs on its own ---- */

/* A job like *want (its kind and arguments), run to its end; *want then holds what it
 * reported (result, and for a retry's part upto and more). */
static int special(struct store *s, struct job *want)
{
	struct job *j;
	int rc;

	if (s->in_txn)
		return -EINVAL;
	if (!(j = malloc(sizeof(*j))))
		return -ENOMEM;
	*j = *want;
	rc = job_run_sync(s, j);
	if (!rc) {
		want->result = j->result;
		want->upto = j->upto;
		want->more = j->more;
	}
	job_free(j);
	return rc == -ECANCELED ? -EIO : rc;
}

int store_dead_letters_retry_part(struct store *s, int64_t now_ms, int64_t *upto, size_t max_rows,
                                  size_t *n, bool *more)
{
	struct job want = {
	    .kind = JOB_RETRY_DEAD, .arg = now_ms, .upto = *upto, .max_rows = max_rows};
	int rc = special(s, &want);

	*n = rc ? 0 : want.result;
	*more = rc ? false : want.more;
	if (!rc)
		*upto = want.upto;
	return rc;
}

int store_dead_letters_retry(struct store *s, int64_t now_ms, size_t *n)
{
	int64_t upto = -1;
	bool more;

	return store_dead_letters_retry_part(s, now_ms, &upto, 0, n, &more);
}

int store_purge_closed(struct store *s, int64_t before_ms, size_t *removed)
{
	struct job want = {.kind = JOB_PURGE, .arg = before_ms};
	int rc = special(s, &want);

	*removed = rc ? 0 : want.result;
	return rc;
}

int store_idle(struct store *s)
{
	if (s->in_txn)
		return -EINVAL;
	buf_free(&s->batch);
	buf_free(&s->packed);
	buf_free(&s->ops);
	pthread_mutex_lock(&s->qmu);
	s->idle_wanted = true;
	pthread_cond_signal(&s->qcv);
	pthread_mutex_unlock(&s->qmu);
	return 0;
}

bool store_in_transaction(const struct store *s)
{
	return s && s->in_txn;
}

size_t store_repairs_in_transaction(const struct store *s)
{
	return s && s->in_txn ? s->txn_repairs : 0;
}
