/* The local store of store.h on SQLite: the schema, statements prepared once at open, one
 * transaction per loop turn, and conversations rebuilt from their rows. */
#include "store.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "buf.h"
#include "ddbitem.h"
#include "log.h"

#define STORE_FILE "convod.db"
#define STORE_SCHEMA_VERSION 2 /* 2: the journal table */
#define STORE_APPLICATION_ID 0x636e7664 /* "cnvd": tells our files from other SQLite files */
#define STORE_BUSY_TIMEOUT_MS 100
#define STORE_BUF_KEEP (1024 * 1024) /* larger JSON buffers are freed after use */
/* WAL pages after which the checkpointer thread copies the WAL into the database (SQLite's
 * own automatic checkpoint uses the same 1000, but runs it inside the commit). */
#define STORE_CHECKPOINT_PAGES 1000
/* Under continuous writes the thread's checkpoints never catch up with the WAL's end, and
 * SQLite starts the WAL over only after a checkpoint that did. Past this size the loop,
 * right after a commit, waits for the thread's checkpoint to end and runs one itself: it
 * is the only writer and the only checkpointer then, so it copies all the thread has not,
 * and the next commit starts the WAL over. That wait is the back-pressure that bounds the
 * WAL when writes outrun the thread. (Without waiting, the loop's checkpoint got
 * SQLITE_BUSY or rarely found the thread idle, and a RESTART from the thread starved
 * behind the commits: the WAL grew past 100 MB in the store's unit test.) */
#define STORE_WAL_HARD_PAGES 8000
/* Journal rows after which a commit is followed by a fold (see the schema). */
#define STORE_FOLD_ROWS 8192

/* closed = 0 while open, else the Unix ms of the close.
 *
 * Written for the group commit, where a turn adds messages to many conversations: messages
 * is a rowid table, so that its rows (the large part) are appended to the same few pages,
 * and only the small entries of its (conversation, sk) index land in one page per
 * conversation; clustered by (conversation, sk) instead, every message dirtied a page of
 * whole rows and the commit wrote twice the bytes, at half the speed. For the same reason
 * the spool's unique key starts with sk, whose ULIDs grow with time, so new spool rows are
 * appended too. map is the last column so that the others are read without following the
 * overflow pages of a long map; map_bytes spares the spool statistics from reading maps.
 *
 * Even so, each message written dirtied one page of that index per conversation, and a
 * turn's commit wrote a page to the WAL for each (4 kB per add at 50 connections). So a
 * message is written to the journal first: a rowid table without any index, whose rows
 * are appended to the same few pages whatever the conversation. Once it holds
 * STORE_FOLD_ROWS rows, and before any read that needs the messages table, the journal
 * is folded into messages in one statement, the newest row of each key winning, in key
 * order, and emptied: the index pages are then written once per fold, not once per turn.
 * Reading one conversation (store_load_conversation) merges the journal's rows instead of
 * folding, so that it never writes: it is what rebuilds memory after a failed commit,
 * when the disk may be full. */
#define JOURNAL_SQL                                                                                \
	"CREATE TABLE journal("                                                                    \
	" seq INTEGER PRIMARY KEY,"                                                                \
	" conversation BLOB NOT NULL,"                                                             \
	" sk TEXT NOT NULL,"                                                                       \
	" version INTEGER NOT NULL,"                                                               \
	" updated INTEGER NOT NULL,"                                                               \
	" client_seen INTEGER NOT NULL,"                                                           \
	" map_bytes INTEGER NOT NULL,"                                                             \
	" map TEXT NOT NULL"                                                                       \
	");"
static const char schema_sql[] = "CREATE TABLE conversations("
                                 " id BLOB PRIMARY KEY NOT NULL,"
                                 " updated INTEGER NOT NULL,"
                                 " closed INTEGER NOT NULL DEFAULT 0"
                                 ") WITHOUT ROWID;"
                                 "CREATE TABLE messages("
                                 " conversation BLOB NOT NULL,"
                                 " sk TEXT NOT NULL,"
                                 " version INTEGER NOT NULL,"
                                 " updated INTEGER NOT NULL,"
                                 " client_seen INTEGER NOT NULL,"
                                 " confirmed INTEGER NOT NULL DEFAULT 0,"
                                 " map_bytes INTEGER NOT NULL,"
                                 " map TEXT NOT NULL,"
                                 " PRIMARY KEY(conversation, sk)"
                                 ");"
                                 JOURNAL_SQL
                                 "CREATE TABLE spool("
                                 " seq INTEGER PRIMARY KEY,"
                                 " conversation BLOB NOT NULL,"
                                 " sk TEXT NOT NULL,"
                                 " version INTEGER NOT NULL,"
                                 " enqueued INTEGER NOT NULL,"
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

enum stmt_id {
	ST_BEGIN = 0,
	ST_COMMIT,
	ST_ROLLBACK,
	ST_PUT_MESSAGE,
	ST_FOLD,
	ST_JOURNAL_CLEAR,
	ST_JOURNAL_COUNT,
	ST_PUT_CONVERSATION,
	ST_SET_CLOSED,
	ST_SPOOL_PUT,
	ST_SPOOL_DELETE,
	ST_MESSAGE_CONFIRM,
	ST_DEAD_INSERT,
	ST_LOAD_ONE,
	ST_LOAD_OPEN,
	ST_SPOOL_EACH,
	ST_MESSAGE_GET,
	ST_SPOOL_STATS,
	ST_DEAD_LIST,
	ST_DEAD_TO_SPOOL,
	ST_DEAD_CLEAR,
	ST_PURGE_MESSAGES,
	ST_PURGE_CONVERSATIONS,
	ST_COUNT,
};

/* Both load statements return the same columns: conversation id and updated, then the
 * message columns (NULL for a conversation without messages), in log order. */
#define LOAD_COLUMNS                                                                               \
	"SELECT c.id, c.updated, m.sk, m.version, m.updated, m.client_seen, m.map,"                \
	" max(m.confirmed, coalesce((SELECT p.version FROM spool p"                                \
	" WHERE p.sk = m.sk AND p.conversation = m.conversation), 0))"                              \
	" FROM conversations c LEFT JOIN messages m ON m.conversation = c.id "
/* The spool has no index by conversation: NOT IN reads it once. */
#define PURGEABLE "closed != 0 AND closed < ?1 AND id NOT IN (SELECT conversation FROM spool)"

static const char *const stmt_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_PUT_MESSAGE] =
        "INSERT INTO journal(conversation, sk, version, updated, client_seen, map_bytes, map)"
        " VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    /* The newest journal row of each key (max(seq) picks the row the bare columns come
     * from), in key order, upserted into messages; confirmed is the message row's own. */
    [ST_FOLD] =
        "INSERT INTO messages(conversation, sk, version, updated, client_seen, map_bytes, map)"
        " SELECT conversation, sk, version, updated, client_seen, map_bytes, map FROM"
        " (SELECT *, max(seq) FROM journal GROUP BY conversation, sk) WHERE true"
        " ON CONFLICT(conversation, sk) DO UPDATE"
        " SET version = excluded.version, updated = excluded.updated,"
        " client_seen = excluded.client_seen, map_bytes = excluded.map_bytes,"
        " map = excluded.map",
    [ST_JOURNAL_CLEAR] = "DELETE FROM journal",
    [ST_JOURNAL_COUNT] = "SELECT count(*) FROM journal",
    [ST_PUT_CONVERSATION] = "INSERT INTO conversations(id, updated, closed) VALUES(?1, ?2, 0)"
                            " ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, closed = 0",
    [ST_SET_CLOSED] = "UPDATE conversations SET closed = ?2 WHERE id = ?1",
    [ST_SPOOL_PUT] = "INSERT INTO spool(conversation, sk, version, enqueued)"
                     " VALUES(?1, ?2, ?3, ?4) ON CONFLICT(sk, conversation) DO UPDATE"
                     " SET version = max(version, excluded.version)",
    [ST_SPOOL_DELETE] = "DELETE FROM spool WHERE conversation = ?1 AND sk = ?2 AND version <= ?3",
    [ST_MESSAGE_CONFIRM] = "UPDATE messages SET confirmed = max(confirmed, ?3)"
                           " WHERE conversation = ?1 AND sk = ?2",
    [ST_DEAD_INSERT] = "INSERT INTO dead_letters(conversation, sk, version, item, error, at)"
                       " VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
    /* The columns of LOAD_COLUMNS, from messages and the journal merged: per key the
     * newest journal row if any (src = its seq), else the message row (src = 0). */
    [ST_LOAD_ONE] =
        "SELECT c.id, c.updated, m.sk, m.version, m.updated, m.client_seen, m.map,"
        " max(coalesce((SELECT x.confirmed FROM messages x"
        " WHERE x.conversation = c.id AND x.sk = m.sk), 0),"
        " coalesce((SELECT p.version FROM spool p"
        " WHERE p.sk = m.sk AND p.conversation = c.id), 0))"
        " FROM conversations c LEFT JOIN"
        " (SELECT sk, version, updated, client_seen, map, max(src) FROM"
        " (SELECT sk, version, updated, client_seen, map, 0 AS src FROM messages"
        " WHERE conversation = ?1 UNION ALL"
        " SELECT sk, version, updated, client_seen, map, seq AS src FROM journal"
        " WHERE conversation = ?1) GROUP BY sk) m ON true"
        " WHERE c.id = ?1 ORDER BY m.sk",
    [ST_LOAD_OPEN] = LOAD_COLUMNS "WHERE c.closed = 0 ORDER BY c.id, m.sk",
    [ST_SPOOL_EACH] = "SELECT conversation, sk, version, enqueued FROM spool ORDER BY seq",
    [ST_MESSAGE_GET] =
        "SELECT map, version, updated FROM messages WHERE conversation = ?1 AND sk = ?2",
    [ST_SPOOL_STATS] = "SELECT count(*), coalesce(sum(m.map_bytes), 0),"
                       " coalesce(min(s.enqueued), 0) FROM spool s LEFT JOIN messages m"
                       " ON m.conversation = s.conversation AND m.sk = s.sk",
    [ST_DEAD_LIST] = "SELECT conversation, sk, version, error, at FROM"
                     " (SELECT * FROM dead_letters ORDER BY seq DESC LIMIT ?1) ORDER BY seq",
    /* WHERE true: SQLite's parser needs it before an upsert's ON CONFLICT. */
    [ST_DEAD_TO_SPOOL] =
        "INSERT INTO spool(conversation, sk, version, enqueued)"
        " SELECT conversation, sk, max(version), ?1 FROM dead_letters WHERE true"
        " GROUP BY conversation, sk ORDER BY min(seq)"
        " ON CONFLICT(sk, conversation) DO UPDATE SET version = max(version, excluded.version)",
    [ST_DEAD_CLEAR] = "DELETE FROM dead_letters",
    [ST_PURGE_MESSAGES] = "DELETE FROM messages WHERE conversation IN"
                          " (SELECT id FROM conversations WHERE " PURGEABLE ")",
    [ST_PURGE_CONVERSATIONS] = "DELETE FROM conversations WHERE " PURGEABLE,
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
	bool running;      /* a checkpoint runs: the thread's, or the loop's own */
	int last_rc;       /* SQLite code of the last checkpoint */
	int reported_rc;   /* what the loop thread last logged */
	uint64_t runs;     /* checkpoints done */
	const char *path;  /* the store's */
	enum durability durability;
};

struct store {
	sqlite3 *db;
	struct checkpointer ck;
	char *path; /* DIR/convod.db, for messages */
	sqlite3_stmt *st[ST_COUNT];
	bool in_txn;
	int txn_err; /* first failed write of the open transaction, 0 if none */
	struct buf json; /* JSON text of the last store_put_message, reused */
	uint64_t journal_rows;     /* committed rows in the journal (an upper bound) */
	uint64_t txn_journal_rows; /* the same as the open transaction sees it */
	uint64_t fold_at;          /* fold after a commit once journal_rows reaches it */
	bool fold_failing;         /* the last fold failed (logged once) */
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

static int bind_text(sqlite3_stmt *st, int i, const char *text)
{
	if (!text)
		return sqlite3_bind_null(st, i);
	return sqlite3_bind_text64(st, i, text, strlen(text), SQLITE_STATIC, SQLITE_UTF8);
}

/* Binds conversation (?1) and sk (?2), the key of most statements. */
static int bind_key(struct store *s, enum stmt_id id, const char *conv, size_t conv_len,
                    const char *sk)
{
	sqlite3_stmt *st = s->st[id];
	int rc;
	if (!conv || !sk)
		return -EINVAL;
	if ((rc = bind_conv(st, 1, conv, conv_len)) != SQLITE_OK ||
	    (rc = bind_text(st, 2, sk)) != SQLITE_OK)
		return fail(s, st, rc);
	return 0;
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
	rc = sqlite3_exec(db,
	                  durability == DURABILITY_MACHINE ? "PRAGMA synchronous=FULL"
	                                                   : "PRAGMA synchronous=NORMAL",
	                  NULL, NULL, NULL);
	if (rc != SQLITE_OK)
		goto not_ours;
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
		/* Schema 1 had no journal: add it. */
		char sql[64];
		snprintf(sql, sizeof(sql), "PRAGMA user_version=%d; COMMIT", STORE_SCHEMA_VERSION);
		rc = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, JOURNAL_SQL, NULL, NULL, NULL);
		if (rc == SQLITE_OK)
			rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
		if (rc != SQLITE_OK) {
			int err = errno_of(db, rc);
			set_errbuf(errbuf, errlen, "%s: cannot upgrade the schema from %" PRId64 ": %s",
			           s->path, version, sqlite3_errmsg(db));
			if (!sqlite3_get_autocommit(db))
				sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
			return err;
		}
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

static void *checkpointer_main(void *arg)
{
	struct checkpointer *ck = arg;
	sqlite3 *db = NULL;

	pthread_mutex_lock(&ck->mu);
	for (;;) {
		while ((!ck->wanted || ck->running) && !ck->stop)
			pthread_cond_wait(&ck->cv, &ck->mu);
		if (ck->stop)
			break;
		ck->wanted = false;
		ck->running = true;
		pthread_mutex_unlock(&ck->mu);
		int rc = SQLITE_OK;
		if (!db) {
			rc = sqlite3_open_v2(ck->path, &db,
			                     SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX |
			                         SQLITE_OPEN_EXRESCODE,
			                     NULL);
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
		if (db)
			rc = sqlite3_wal_checkpoint_v2(db, NULL, SQLITE_CHECKPOINT_PASSIVE, NULL,
			                               NULL);
		pthread_mutex_lock(&ck->mu);
		ck->running = false;
		/* SQLITE_BUSY: the WAL was being started over at that moment; the next round
		 * copies what this one could not. Not a failure to report. */
		if (rc != SQLITE_BUSY)
			ck->last_rc = rc;
		pthread_cond_broadcast(&ck->cv); /* a loop waiting to checkpoint itself */
		ck->runs++;
	}
	pthread_mutex_unlock(&ck->mu);
	sqlite3_close(db);
	return NULL;
}

/* SQLite calls this after every commit with the WAL's size in pages (it replaces the
 * automatic checkpoint, which is thereby off). */
static int wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
	struct store *s = arg;
	struct checkpointer *ck = &s->ck;
	int rc;

	bool self = false;

	if (pages < STORE_CHECKPOINT_PAGES)
		return SQLITE_OK;
	pthread_mutex_lock(&ck->mu);
	if (pages >= STORE_WAL_HARD_PAGES) {
		/* The thread fell behind: the loop waits for its checkpoint to end (the
		 * back-pressure that bounds the WAL), then takes the rest itself. */
		while (ck->running)
			pthread_cond_wait(&ck->cv, &ck->mu);
		ck->running = self = true;
	} else {
		ck->wanted = true;
		pthread_cond_signal(&ck->cv);
	}
	rc = ck->last_rc;
	pthread_mutex_unlock(&ck->mu);
	if (self) {
		/* No other writer (this is it) and no other checkpointer: it copies all the
		 * thread has not, and the next commit starts the WAL over. */
		rc = sqlite3_wal_checkpoint_v2(db, name, SQLITE_CHECKPOINT_PASSIVE, NULL, NULL);
		pthread_mutex_lock(&ck->mu);
		ck->running = false;
		ck->last_rc = rc;
		pthread_cond_broadcast(&ck->cv);
		pthread_mutex_unlock(&ck->mu);
	}
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

	ck->path = s->path;
	ck->durability = durability;
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

int store_open(const char *dir, enum durability durability, struct store **out, char *errbuf,
               size_t errlen)
{
	struct store *s = NULL;
	struct stat sb;
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

	rc = sqlite3_open_v2(s->path, &s->db,
	                     SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX |
	                         SQLITE_OPEN_EXRESCODE,
	                     NULL);
	if (rc != SQLITE_OK) {
		int e = s->db ? sqlite3_system_errno(s->db) : 0;
		set_errbuf(errbuf, errlen, "cannot open %s: %s%s%s", s->path,
		           s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc), e ? ": " : "",
		           e ? strerror(e) : "");
		rc = e ? -e : errno_of(s->db, rc);
		goto fail;
	}
	sqlite3_busy_timeout(s->db, STORE_BUSY_TIMEOUT_MS);
	if ((rc = open_checks(s, durability, errbuf, errlen)) < 0)
		goto fail;
	{
		int64_t rows = 0;
		sqlite3_stmt *st = s->st[ST_JOURNAL_COUNT];
		if (sqlite3_step(st) == SQLITE_ROW)
			rows = sqlite3_column_int64(st, 0);
		sqlite3_reset(st);
		/* Unknown counts as non-empty: the first read folds whatever is there. */
		s->journal_rows = rows > 0 ? (uint64_t)rows : 1;
		s->fold_at = STORE_FOLD_ROWS;
	}
	/* Pages the loop reads again (the conversations' index, the spool) stay in memory. */
	sqlite3_exec(s->db, "PRAGMA cache_size=-32768", NULL, NULL, NULL);
	if ((rc = checkpointer_start(s, durability)) < 0) {
		set_errbuf(errbuf, errlen, "store: cannot start the checkpoint thread: %s",
		           strerror(-rc));
		goto fail;
	}
	*out = s;
	return 0;
fail:
	store_close(s);
	return rc;
}

static int settle(struct store *s);
static void fold_maybe(struct store *s);

void store_close(struct store *s)
{
	if (!s)
		return;
	store_rollback(s);
	/* The next start then finds the messages table complete. */
	if (s->st[ST_FOLD] && s->journal_rows)
		settle(s);
	checkpointer_stop(s);
	for (int i = 0; i < ST_COUNT; i++)
		sqlite3_finalize(s->st[i]);
	if (s->db && sqlite3_close(s->db) != SQLITE_OK)
		log_msg(LOG_ERROR, "store", "%s: close: %s", s->path, sqlite3_errmsg(s->db));
	buf_free(&s->json);
	free(s->path);
	free(s);
}

int store_set_size_limit(struct store *s, uint64_t max_bytes)
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

int store_begin(struct store *s)
{
	int rc;
	if (s->in_txn)
		return -EINVAL;
	if ((rc = run(s, s->st[ST_BEGIN])) < 0)
		return rc;
	s->in_txn = true;
	s->txn_err = 0;
	s->txn_journal_rows = s->journal_rows;
	return 0;
}

void store_rollback(struct store *s)
{
	if (!s->in_txn)
		return;
	/* SQLite rolls some failures (a full disk, I/O errors) back by itself. */
	if (!sqlite3_get_autocommit(s->db))
		run(s, s->st[ST_ROLLBACK]);
	s->in_txn = false;
	s->txn_err = 0;
}

int store_commit(struct store *s)
{
	int rc;
	if (!s->in_txn)
		return -EINVAL;
	if (s->txn_err) {
		rc = s->txn_err;
		store_rollback(s);
		return rc;
	}
	rc = run(s, s->st[ST_COMMIT]);
	if (rc < 0) {
		store_rollback(s);
		return rc;
	}
	s->in_txn = false;
	s->journal_rows = s->txn_journal_rows;
	fold_maybe(s);
	return 0;
}

/* Folds the journal into messages inside the open transaction. 0 or -errno (logged). */
static int fold(struct store *s)
{
	int rc;
	if ((rc = run(s, s->st[ST_FOLD])) == 0 && (rc = run(s, s->st[ST_JOURNAL_CLEAR])) == 0)
		s->txn_journal_rows = 0;
	return rc;
}

/* Makes the messages table complete before a read or an update of it: folds the journal
 * inside the open transaction, or in one of its own. 0 or -errno. */
static int settle(struct store *s)
{
	int rc;
	if (s->in_txn) {
		if (!s->txn_journal_rows)
			return s->txn_err;
		if ((rc = write_check(s)) < 0)
			return rc;
		return write_done(s, fold(s));
	}
	if (!s->journal_rows)
		return 0;
	if ((rc = store_begin(s)) < 0)
		return rc;
	if ((rc = fold(s)) < 0) {
		store_rollback(s);
		return rc;
	}
	return store_commit(s);
}

/* After a commit: once the journal is long enough, folds it in a transaction of its own,
 * so that a failing fold (a full disk) never fails the turn's writes. A failed fold is
 * tried again STORE_FOLD_ROWS rows later; reads fold (or merge) whatever is left. */
static void fold_maybe(struct store *s)
{
	int rc;
	if (s->journal_rows < s->fold_at)
		return;
	rc = settle(s);
	if (rc < 0) {
		if (!s->fold_failing)
			log_msg(LOG_WARN, "store",
			        "%s: cannot fold the journal into the messages table (%s); "
			        "trying again later",
			        s->path, strerror(-rc));
		s->fold_failing = true;
		s->fold_at = s->journal_rows + STORE_FOLD_ROWS;
		return;
	}
	s->fold_failing = false;
	s->fold_at = STORE_FOLD_ROWS;
}

int store_put_message(struct store *s, const char *conv, size_t conv_len, const struct message *m)
{
	sqlite3_stmt *st = s->st[ST_PUT_MESSAGE];
	char sk[MESSAGE_SK_MAX + 1];
	int rc = write_check(s);

	if (rc)
		return rc;
	/* A summary's key needs the last id it summarizes (see ddbitem_sort_key). */
	if (!m || !m->version || (m->role == ROLE_SUMMARY && !m->nsummary_ids))
		return -EINVAL;
	message_sort_key(m, sk);
	s->json.len = 0;
	if ((rc = message_write_map(&s->json, m)) < 0)
		goto out;
	if ((rc = bind_key(s, ST_PUT_MESSAGE, conv, conv_len, sk)) < 0)
		goto out;
	if (sqlite3_bind_int64(st, 3, m->version) != SQLITE_OK ||
	    sqlite3_bind_int64(st, 4, m->updated_ms) != SQLITE_OK ||
	    sqlite3_bind_int64(st, 5, m->seen[CONSUMER_CLIENT]) != SQLITE_OK ||
	    sqlite3_bind_int64(st, 6, (sqlite3_int64)s->json.len) != SQLITE_OK ||
	    (rc = sqlite3_bind_text64(st, 7, s->json.data, s->json.len, SQLITE_STATIC,
	                              SQLITE_UTF8)) !=
	        SQLITE_OK) {
		rc = fail(s, st, rc ? rc : SQLITE_ERROR);
		goto out;
	}
	if ((rc = run(s, st)) == 0)
		s->txn_journal_rows++;
out:
	if (s->json.cap > STORE_BUF_KEEP)
		buf_free(&s->json);
	s->json.len = 0;
	return write_done(s, rc);
}

int store_put_conversation(struct store *s, const struct convo *c)
{
	sqlite3_stmt *st = s->st[ST_PUT_CONVERSATION];
	int rc = write_check(s);
	if (rc)
		return rc;
	if (!c || !c->id)
		return -EINVAL;
	if ((rc = bind_conv(st, 1, c->id, c->id_len)) != SQLITE_OK ||
	    (rc = sqlite3_bind_int64(st, 2, c->updated_ms)) != SQLITE_OK)
		return write_done(s, fail(s, st, rc));
	return write_done(s, run(s, st));
}

int store_set_closed(struct store *s, const char *conv, size_t conv_len, int64_t closed_ms)
{
	sqlite3_stmt *st = s->st[ST_SET_CLOSED];
	int rc = write_check(s);
	if (rc)
		return rc;
	if (!conv)
		return -EINVAL;
	if ((rc = bind_conv(st, 1, conv, conv_len)) != SQLITE_OK ||
	    (rc = sqlite3_bind_int64(st, 2, closed_ms < 1 ? 1 : closed_ms)) != SQLITE_OK)
		return write_done(s, fail(s, st, rc));
	return write_done(s, run(s, st));
}

int store_spool_put(struct store *s, const char *conv, size_t conv_len, const char *sk,
                    uint32_t version, int64_t now_ms)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_PUT];
	int rc = write_check(s);
	if (rc)
		return rc;
	if ((rc = bind_key(s, ST_SPOOL_PUT, conv, conv_len, sk)) < 0)
		return write_done(s, rc);
	if ((rc = sqlite3_bind_int64(st, 3, version)) != SQLITE_OK ||
	    (rc = sqlite3_bind_int64(st, 4, now_ms)) != SQLITE_OK)
		return write_done(s, fail(s, st, rc));
	return write_done(s, run(s, st));
}

/* Deletes the spool row of (conv, sk) if its version is at most version. */
static int spool_delete(struct store *s, const char *conv, size_t conv_len, const char *sk,
                        uint32_t version)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_DELETE];
	int rc;
	if ((rc = bind_key(s, ST_SPOOL_DELETE, conv, conv_len, sk)) < 0)
		return rc;
	if ((rc = sqlite3_bind_int64(st, 3, version)) != SQLITE_OK)
		return fail(s, st, rc);
	return run(s, st);
}

int store_spool_done(struct store *s, const char *conv, size_t conv_len, const char *sk,
                     uint32_t version)
{
	sqlite3_stmt *st = s->st[ST_MESSAGE_CONFIRM];
	int rc = write_check(s);
	if (rc)
		return rc;
	if ((rc = settle(s)) < 0) /* the message row may still be in the journal */
		return rc;
	if ((rc = spool_delete(s, conv, conv_len, sk, version)) < 0)
		return write_done(s, rc);
	if ((rc = bind_key(s, ST_MESSAGE_CONFIRM, conv, conv_len, sk)) < 0)
		return write_done(s, rc);
	if ((rc = sqlite3_bind_int64(st, 3, version)) != SQLITE_OK)
		return write_done(s, fail(s, st, rc));
	return write_done(s, run(s, st));
}

int store_dead_letter(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version, const char *item_json, const char *error, int64_t now_ms)
{
	sqlite3_stmt *st = s->st[ST_DEAD_INSERT];
	int rc = write_check(s);
	if (rc)
		return rc;
	if ((rc = bind_key(s, ST_DEAD_INSERT, conv, conv_len, sk)) < 0)
		return write_done(s, rc);
	if ((rc = sqlite3_bind_int64(st, 3, version)) != SQLITE_OK ||
	    (rc = bind_text(st, 4, item_json)) != SQLITE_OK ||
	    (rc = bind_text(st, 5, error ? error : "")) != SQLITE_OK ||
	    (rc = sqlite3_bind_int64(st, 6, now_ms)) != SQLITE_OK)
		return write_done(s, fail(s, st, rc));
	if ((rc = run(s, st)) < 0)
		return write_done(s, rc);
	return write_done(s, spool_delete(s, conv, conv_len, sk, version));
}

/* Logs a row that cannot be read back and returns -EIO. */
static int bad_row(struct store *s, const char *conv, size_t conv_len, const char *sk,
                   const char *what)
{
	log_msg(LOG_ERROR, "store", "%s: conversation \"%.*s\"%s%s: %s", s->path,
	        (int)(conv_len > 200 ? 200 : conv_len), conv, sk ? " message " : "", sk ? sk : "",
	        what);
	return -EIO;
}

/* The message of the current row of a load statement (columns 2..6). */
static int row_message(struct store *s, sqlite3_stmt *st, const struct convo *c,
                       struct message **out)
{
	const char *sk = (const char *)sqlite3_column_text(st, 2);
	int64_t version = sqlite3_column_int64(st, 3);
	int64_t client_seen = sqlite3_column_int64(st, 5);
	const char *text = (const char *)sqlite3_column_text(st, 6);
	size_t text_len = (size_t)sqlite3_column_bytes(st, 6);
	char key[DDBITEM_SK_MAX + 1];
	struct message *m = NULL;
	struct error e;
	json_error_t je;
	json_t *map = NULL;
	int rc = 0;

	*out = NULL;
	if (!sk || !text) {
		rc = sqlite3_errcode(s->db) == SQLITE_NOMEM
		         ? -ENOMEM
		         : bad_row(s, c->id, c->id_len, sk, "missing sort key or map");
		goto out;
	}
	if (version < 1 || version > UINT32_MAX || client_seen < 0 || client_seen > version) {
		rc = bad_row(s, c->id, c->id_len, sk, "version out of range");
		goto out;
	}
	if (!(map = json_loadb(text, text_len, JSON_ALLOW_NUL, &je))) {
		rc = bad_row(s, c->id, c->id_len, sk, je.text);
		goto out;
	}
	if (message_from_map(map, (uint32_t)version, &m, &e) != ERR_OK) {
		rc = bad_row(s, c->id, c->id_len, sk, e.message);
		goto out;
	}
	if (ddbitem_sort_key(map, key, &e) != ERR_OK || strcmp(key, sk) != 0) {
		rc = bad_row(s, c->id, c->id_len, sk, "sort key does not match the message");
		goto out;
	}
	m->updated_ms = sqlite3_column_int64(st, 4);
	m->seen[CONSUMER_STORE] = (uint32_t)version;
	/* Taken by the sink only when confirmed or spooled at this version: a version whose
	 * spool row was never committed is taken again. */
	{
		int64_t covered = sqlite3_column_int64(st, 7);
		m->seen[CONSUMER_SINK] = covered >= version ? (uint32_t)version : (uint32_t)covered;
	}
	m->seen[CONSUMER_CLIENT] = (uint32_t)client_seen;
	*out = m;
	m = NULL;
out:
	message_free(m);
	json_decref(map);
	return rc;
}

/* Reads one conversation from a load statement standing on its first row (*step is
 * SQLITE_ROW) and leaves the statement on the next conversation's first row, or done; *step
 * is the last sqlite3_step result. Caller frees *out. */
static int load_rows(struct store *s, sqlite3_stmt *st, int *step, struct convo **out)
{
	const void *id = sqlite3_column_blob(st, 0);
	size_t id_len = (size_t)sqlite3_column_bytes(st, 0);
	int64_t updated = sqlite3_column_int64(st, 1);
	struct convo *c = NULL;
	struct message *m;
	struct error e;
	int rc = 0;

	*out = NULL;
	if (!(c = convo_new(id_len ? id : "", id_len))) {
		rc = -ENOMEM;
		goto out;
	}
	for (;;) {
		if (sqlite3_column_type(st, 2) != SQLITE_NULL) {
			if ((rc = row_message(s, st, c, &m)) < 0)
				goto out;
			if ((rc = convo_restore_append(c, m)) < 0)
				goto out;
		}
		*step = sqlite3_step(st);
		if (*step != SQLITE_ROW)
			break;
		id = sqlite3_column_blob(st, 0);
		if ((size_t)sqlite3_column_bytes(st, 0) != c->id_len ||
		    (c->id_len && memcmp(id, c->id, c->id_len) != 0))
			break;
	}
	if (*step != SQLITE_ROW && *step != SQLITE_DONE) {
		rc = fail(s, st, *step);
		goto out;
	}
	if (convo_restore_finish(c, &e) != ERR_OK) {
		rc = bad_row(s, c->id, c->id_len, NULL, e.message);
		goto out;
	}
	if (updated > c->updated_ms)
		c->updated_ms = updated;
	*out = c;
	c = NULL;
out:
	convo_free(c);
	return rc;
}

int store_load_conversation(struct store *s, const char *conv, size_t conv_len, struct convo **out)
{
	sqlite3_stmt *st = s->st[ST_LOAD_ONE];
	int rc, step;

	*out = NULL;
	if (!conv)
		return -EINVAL;
	if ((rc = bind_conv(st, 1, conv, conv_len)) != SQLITE_OK)
		return fail(s, st, rc);
	step = sqlite3_step(st);
	if (step == SQLITE_DONE)
		rc = -ENOENT;
	else if (step != SQLITE_ROW)
		rc = fail(s, st, step);
	else
		rc = load_rows(s, st, &step, out);
	sqlite3_reset(st);
	return rc;
}

int store_load_open(struct store *s, int (*fn)(void *arg, struct convo *c), void *arg)
{
	sqlite3_stmt *st = s->st[ST_LOAD_OPEN];
	struct convo *c;
	int rc, step;

	if ((rc = settle(s)) < 0)
		return rc;
	step = sqlite3_step(st);

	while (step == SQLITE_ROW) {
		if ((rc = load_rows(s, st, &step, &c)) < 0)
			break;
		if ((rc = fn(arg, c)) != 0)
			break;
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

int store_spool_each(struct store *s,
                     int (*fn)(void *arg, const char *conv, size_t conv_len, const char *sk,
                               uint32_t version, int64_t enqueued_ms),
                     void *arg)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_EACH];
	int rc = 0, step;

	while ((step = sqlite3_step(st)) == SQLITE_ROW) {
		const char *conv = sqlite3_column_blob(st, 0);
		size_t conv_len = (size_t)sqlite3_column_bytes(st, 0);
		const char *sk = (const char *)sqlite3_column_text(st, 1);
		int64_t version = sqlite3_column_int64(st, 2);
		if (!sk || version < 0 || version > UINT32_MAX) {
			rc = bad_row(s, conv ? conv : "", conv_len, sk, "bad spool row");
			break;
		}
		if ((rc = fn(arg, conv ? conv : "", conv_len, sk, (uint32_t)version,
		             sqlite3_column_int64(st, 3))) != 0)
			break;
	}
	if (!rc && step != SQLITE_DONE)
		rc = fail(s, st, step);
	sqlite3_reset(st);
	return rc;
}

int store_message_get(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      json_t **map, uint32_t *version, int64_t *updated_ms)
{
	sqlite3_stmt *st = s->st[ST_MESSAGE_GET];
	json_error_t je;
	int rc, step;

	*map = NULL;
	if ((rc = settle(s)) < 0 || (rc = bind_key(s, ST_MESSAGE_GET, conv, conv_len, sk)) < 0)
		return rc;
	step = sqlite3_step(st);
	if (step == SQLITE_DONE) {
		rc = -ENOENT;
	} else if (step != SQLITE_ROW) {
		rc = fail(s, st, step);
	} else {
		const char *text = (const char *)sqlite3_column_text(st, 0);
		int64_t v = sqlite3_column_int64(st, 1);
		if (!text || v < 1 || v > UINT32_MAX)
			rc = bad_row(s, conv, conv_len, sk, "bad message row");
		else if (!(*map = json_loadb(text, (size_t)sqlite3_column_bytes(st, 0),
		                             JSON_ALLOW_NUL, &je)))
			rc = bad_row(s, conv, conv_len, sk, je.text);
		if (!rc) {
			*version = (uint32_t)v;
			*updated_ms = sqlite3_column_int64(st, 2);
		}
	}
	sqlite3_reset(st);
	return rc;
}

int store_spool_stats(struct store *s, uint64_t *items, uint64_t *bytes, int64_t *oldest_ms)
{
	sqlite3_stmt *st = s->st[ST_SPOOL_STATS];
	int rc, step;

	if ((rc = settle(s)) < 0) /* map_bytes of messages still in the journal */
		return rc;
	step = sqlite3_step(st);
	if (step == SQLITE_ROW) {
		*items = (uint64_t)sqlite3_column_int64(st, 0);
		*bytes = (uint64_t)sqlite3_column_int64(st, 1);
		*oldest_ms = sqlite3_column_int64(st, 2);
	} else {
		rc = fail(s, st, step);
	}
	sqlite3_reset(st);
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

int store_dead_letters(struct store *s, size_t limit, json_t **out)
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

/* Writes that callers may run outside a transaction get one of their own. */
static int own_begin(struct store *s, bool *own)
{
	*own = !s->in_txn;
	return *own ? store_begin(s) : s->txn_err;
}

static int own_end(struct store *s, bool own, int rc)
{
	if (!own)
		return write_done(s, rc);
	if (rc < 0) {
		store_rollback(s);
		return rc;
	}
	return store_commit(s);
}

int store_dead_letters_retry(struct store *s, int64_t now_ms, size_t *n)
{
	sqlite3_stmt *st = s->st[ST_DEAD_TO_SPOOL];
	bool own;
	int rc;

	*n = 0;
	if ((rc = own_begin(s, &own)) < 0)
		return rc;
	if ((rc = sqlite3_bind_int64(st, 1, now_ms)) != SQLITE_OK)
		rc = fail(s, st, rc);
	else if ((rc = run(s, st)) == 0 && (rc = run(s, s->st[ST_DEAD_CLEAR])) == 0)
		*n = (size_t)sqlite3_changes64(s->db);
	rc = own_end(s, own, rc);
	if (rc < 0)
		*n = 0;
	return rc;
}

int store_purge_closed(struct store *s, int64_t before_ms, size_t *removed)
{
	bool own;
	int rc;

	*removed = 0;
	if ((rc = own_begin(s, &own)) < 0)
		return rc;
	rc = settle(s); /* journal rows of a purged conversation would come back */
	for (int i = ST_PURGE_MESSAGES; !rc && i <= ST_PURGE_CONVERSATIONS; i++) {
		if ((rc = sqlite3_bind_int64(s->st[i], 1, before_ms)) != SQLITE_OK)
			rc = fail(s, s->st[i], rc);
		else
			rc = run(s, s->st[i]);
	}
	if (!rc)
		*removed = (size_t)sqlite3_changes64(s->db);
	rc = own_end(s, own, rc);
	if (rc < 0)
		*removed = 0;
	return rc;
}

bool store_in_transaction(const struct store *s)
{
	return s && s->in_txn;
}
