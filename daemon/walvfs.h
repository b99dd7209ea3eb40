/* walvfs: an SQLite VFS over the default one that writes each commit's WAL frames in one
 * system call instead of two per frame. */
#ifndef CONVOD_WALVFS_H
#define CONVOD_WALVFS_H

/* The name to pass to sqlite3_open_v2. */
#define WALVFS_NAME "convod-wal"
/* The same, for a database whose commits are synced (synchronous=FULL): a commit whose sync
 * fails is also spoiled in the WAL file (its commit frame's salts), so that a crash before
 * the next commit cannot bring it back at recovery (SQLite answered it as failed). The
 * database must run with PRAGMA checkpoint_fullfsync=ON (and fullfsync off): a commit's
 * sync is then the only one of the WAL with SQLITE_SYNC_NORMAL, and a failed sync of a
 * checkpoint (which may follow a commit at synchronous=NORMAL, which stands) spoils
 * nothing. */
#define WALVFS_SYNCED_NAME "convod-wal-synced"

/* Registers the VFS (not as the default) once per process; later calls only return the
 * first one's result. Thread-safe. 0 or -ENOSYS (no default VFS) or -ENOMEM. */
int walvfs_register(void);

/* What files took through the VFS since the process started: the writes it made to WAL
 * files, and the writes of SQLite's (frame headers and pages) it gathered into some of them;
 * the syncs that succeeded, of WAL files and of the others (the database files). */
struct walvfs_counts {
	unsigned long long writes;
	unsigned long long gathered;
	unsigned long long wal_syncs;
	unsigned long long other_syncs;
	unsigned long long spoiled;      /* commits spoiled after their sync failed */
	unsigned long long spoil_failed; /* and those whose spoiling failed too (logged) */
};
void walvfs_counts(struct walvfs_counts *out);

#endif
