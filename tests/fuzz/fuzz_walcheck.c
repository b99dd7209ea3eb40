/* Fuzz target for walcheck (daemon/walcheck.h), which reads a WAL file before SQLite does at
 * every start: the file may be damaged in any way, so every byte string must read without a
 * fault, and what walcheck says of it must hold together:
 *
 * - the counts are ordered: kept commits <= kept frames <= frames, and nothing is kept from a
 *   file whose header is not whole; the frames are as many as the file holds at the page
 *   size read (0 when none could be chosen);
 * - commits dropped (lost_commits) come with the frame where recovery stops, after the
 *   frames it keeps, and the last of them lies within the frames of this WAL; the last
 *   frame kept and the last dropped are commit frames, and the last frame of this WAL is
 *   the last with its salts (read here from the bytes);
 * - cutting the file after the frames recovery keeps leaves the same kept commits and none
 *   dropped; cutting it after the last dropped commit leaves the same answer; the same file
 *   read twice gives the same answer.
 *
 * The input's first byte chooses the database's page size given as the hint (its value
 * times 512: 0, the valid sizes, and invalid ones); the rest is the file. */
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz.h"
#include "walcheck.h"

#define WAL_HEADER 32
#define FRAME_HEADER 24

static int file_of(const uint8_t *p, size_t n)
{
	int fd = memfd_create("wal", MFD_CLOEXEC);
	size_t done = 0;

	FUZZ_REQUIRE(fd >= 0, "memfd_create failed");
	while (done < n) {
		ssize_t w = write(fd, p + done, n - done);
		FUZZ_REQUIRE(w > 0, "cannot write the input to its file");
		done += (size_t)w;
	}
	return fd;
}

static struct walcheck scan(const uint8_t *p, size_t n, uint32_t hint)
{
	struct walcheck w;
	int fd = file_of(p, n);

	FUZZ_REQUIRE(walcheck_scan(fd, hint, &w) == 0, "a read of a memory file failed");
	close(fd);
	return w;
}

static int same(const struct walcheck *a, const struct walcheck *b)
{
	return a->header_ok == b->header_ok && a->page_size == b->page_size &&
	       a->frames == b->frames && a->kept_frames == b->kept_frames &&
	       a->kept_commits == b->kept_commits && a->first_bad == b->first_bad &&
	       a->lost_commits == b->lost_commits && a->last_lost == b->last_lost &&
	       a->last_own == b->last_own && a->broken_commits == b->broken_commits;
}

/* Frame j (from 1) of the file at page size ps. */
static const uint8_t *frame_at(const uint8_t *file, uint32_t ps, long long j)
{
	return file + WAL_HEADER + (size_t)(j - 1) * (FRAME_HEADER + ps);
}

/* Whether frame j ends a commit (its second word, the database size after it, is not 0). */
static bool is_commit(const uint8_t *file, uint32_t ps, long long j)
{
	const uint8_t *f = frame_at(file, ps, j);
	return f[4] | f[5] | f[6] | f[7];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	uint32_t hint;
	struct walcheck w, again;
	size_t frame;

	if (size < 1)
		return 0;
	hint = (uint32_t)data[0] * 512;
	data++;
	size--;
	w = scan(data, size, hint);

	FUZZ_REQUIRE(w.kept_commits >= 0 && w.kept_commits <= w.kept_frames &&
	                 w.kept_frames <= w.frames,
	             "counts out of order: %lld commits in %lld kept frames of %lld",
	             (long long)w.kept_commits, (long long)w.kept_frames, (long long)w.frames);
	FUZZ_REQUIRE(w.header_ok || w.kept_frames == 0, "frames kept behind a broken header");
	if (w.page_size == 0) {
		FUZZ_REQUIRE(w.frames == 0 && !w.lost_commits, "frames read at no page size");
	} else {
		FUZZ_REQUIRE(w.page_size >= 512 && w.page_size <= 65536 &&
		                 !(w.page_size & (w.page_size - 1)),
		             "page size %u", w.page_size);
		frame = FRAME_HEADER + w.page_size;
		FUZZ_REQUIRE(
		    w.frames == (size > WAL_HEADER ? (long long)((size - WAL_HEADER) / frame) : 0),
		    "%lld frames in %zu bytes at %u", (long long)w.frames, size, w.page_size);
	}
	FUZZ_REQUIRE(!w.lost_commits == !w.first_bad, "dropped commits without a first bad "
	                                              "frame, or the other way");
	if (w.lost_commits) {
		FUZZ_REQUIRE(w.kept_frames < w.first_bad && w.first_bad <= w.last_lost &&
		                 w.last_lost <= w.last_own && w.last_own <= w.frames &&
		                 w.lost_commits <= w.last_lost - w.first_bad + 1,
		             "frames out of order: kept %lld, first bad %lld, %lld lost up to "
		             "%lld, last own %lld of %lld",
		             (long long)w.kept_frames, (long long)w.first_bad,
		             (long long)w.lost_commits, (long long)w.last_lost,
		             (long long)w.last_own, (long long)w.frames);
	}

	if (w.frames) {
		/* This WAL's salts: the header's, or frame 1's when the header is not whole. */
		const uint8_t *salt = w.header_ok ? data + 16 : data + WAL_HEADER + 8;
		long long own = 0;
		for (long long j = 1; j <= w.frames; j++)
			if (memcmp(frame_at(data, w.page_size, j) + 8, salt, 8) == 0)
				own = j;
		FUZZ_REQUIRE(w.last_own == own, "the last frame of this WAL is %lld, not %lld", own,
		             (long long)w.last_own);
		FUZZ_REQUIRE(!w.kept_frames || is_commit(data, w.page_size, w.kept_frames),
		             "the last frame kept, %lld, is not a commit",
		             (long long)w.kept_frames);
		FUZZ_REQUIRE(!w.lost_commits || is_commit(data, w.page_size, w.last_lost),
		             "the last commit dropped, %lld, is not a commit",
		             (long long)w.last_lost);
	}

	again = scan(data, size, hint);
	FUZZ_REQUIRE(same(&w, &again), "the same file read twice gave two answers");

	if (w.header_ok) {
		/* Cut after what recovery keeps: the same, and nothing dropped. */
		again = scan(
		    data, WAL_HEADER + (size_t)w.kept_frames * (FRAME_HEADER + w.page_size), hint);
		FUZZ_REQUIRE(again.header_ok && again.kept_frames == w.kept_frames &&
		                 again.kept_commits == w.kept_commits && !again.lost_commits,
		             "cut after its kept frames, the file keeps %lld commits (not %lld) "
		             "and drops %lld",
		             (long long)again.kept_commits, (long long)w.kept_commits,
		             (long long)again.lost_commits);
	}
	if (w.lost_commits && w.header_ok) {
		/* Cut after the last dropped commit: the same answer, but for the frames. */
		again = scan(data, WAL_HEADER + (size_t)w.last_lost * (FRAME_HEADER + w.page_size),
		             hint);
		FUZZ_REQUIRE(again.kept_commits == w.kept_commits &&
		                 again.first_bad == w.first_bad &&
		                 again.lost_commits == w.lost_commits &&
		                 again.last_lost == w.last_lost && again.frames == w.last_lost,
		             "cut after its last dropped commit, the answer changed");
	}
	return 0;
}
