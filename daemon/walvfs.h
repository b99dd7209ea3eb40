/* walvfs: an SQLite VFS over the default one that writes each commit's WAL frames in one
 * system call instead of two per frame. */
#ifndef CONVOD_WALVFS_H
#define CONVOD_WALVFS_H

#include <stdbool.h>

/* The name to pass to sqlite3_open_v2. */
#define WALVFS_NAME "convod-wal"
/* The same, for a database whose commits are synced (synchronous=FULL): a commit whose sync
 * fails is also spoiled in the WAL file, so that a crash before the next commit cannot
 * bring it back at recovery (SQLite answered it as failed). A failed sync elsewhere (a
 * checkpoint's) spoils nothing. */
#define WALVFS_SYNCED_NAME "convod-wal-synced"

/* Registers the VFS (not as the default) once per process; later calls only return the
 * first one's result. Thread-safe. 0 or -ENOSYS (no default VFS) or -ENOMEM. */
int walvfs_register(void);

/* Through WALVFS_SYNCED_NAME, a commit's sync is the one that directly follows its commit
 * frame's write. A commit made at synchronous=NORMAL is not synced, and the next sync may
 * be a checkpoint's: the thread that makes such commits says so (on) before them, and
 * (off) after, so that a checkpoint's failed sync does not spoil a commit that stands. */
void walvfs_commits_unsynced(bool on);

/* What files took through the VFS since the process started: the writes it made to WAL
 * files, and the writes of SQLite's (frame headers and pages) it gathered into some of them;
 * the syncs that succeeded, of WAL files and of the others (the database files). */
struct walvfs_counts {
	unsigned long long writes;
	unsigned long long gathered;
	unsigned long long wal_syncs;
	unsigned long long other_syncs;
	unsigned long long spoiled; /* commits spoiled after their sync failed */
};
void walvfs_counts(struct walvfs_counts *out);

#endif
