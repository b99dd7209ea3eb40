/* walcheck: reads an SQLite WAL file as SQLite's recovery will, and tells whether whole
 * commits lie beyond the point where that recovery stops: a WAL damaged after it was
 * written, whose later commits SQLite drops without a word. */
#ifndef CONVOD_WALCHECK_H
#define CONVOD_WALCHECK_H

#include <stdbool.h>
#include <stdint.h>

/* Frames are counted from 1, as SQLite does. A frame is "whole" when its salts are this
 * WAL's and its checksum follows from the checksum of the frame before it (stored, or
 * computed when that frame's stored one is what was changed; the header's for frame 1):
 * what it would be had nothing been changed since it was written. SQLite's recovery keeps
 * the frames up to the last commit of the run of whole frames that starts at frame 1, if
 * the header itself is whole; frames of an earlier WAL (other salts) end that run as the
 * normal end of the log. When the header is not whole, recovery keeps nothing, and the
 * frames are read all the same: with frame 1's salts, in the byte order under which more
 * commits are whole, at the header's page size or else page_size_hint (the database's). */
struct walcheck {
	bool header_ok;         /* magic, version, page size and checksum of the header */
	uint32_t page_size;     /* the frames were read at (0: none, and nothing was read) */
	int64_t frames;         /* complete frames in the file */
	int64_t kept_frames;    /* the frames recovery keeps (up to its last commit) */
	int64_t kept_commits;   /* the commits among them */
	int64_t first_bad;      /* the first frame recovery rejects while the file holds more
	                         * whole commits of this WAL after it (1 when the header is
	                         * not whole); 0 when nothing whole is dropped */
	int64_t lost_commits;   /* whole commit frames of this WAL at or after first_bad */
	int64_t last_lost;      /* the last of them */
	int64_t last_own;       /* the last frame with this WAL's salts, whole or not */
	int64_t broken_commits; /* frames of this WAL after the run recovery keeps, marked as
	                         * commits but not whole */
};

/* Reads the WAL open on fd from its start (pread). page_size_hint: the database's page
 * size, or 0. 0, or -errno when a read failed. A file shorter than a header gives
 * header_ok false and nothing else. */
int walcheck_scan(int fd, uint32_t page_size_hint, struct walcheck *out);

#endif
