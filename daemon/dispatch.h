/* From one request line to one response line: parse, check the envelope, find or create
 * the conversation, run the op, write the answer. No I/O: the server hands lines in and
 * writes the buffer out after the turn's commit. */
#ifndef CONVOD_DISPATCH_H
#define CONVOD_DISPATCH_H

#include <stdbool.h>
#include <stddef.h>

#include "buf.h"
#include "config.h"
#include "registry.h"
#include "stats.h"
#include "ulid.h"

struct dispatch {
	const struct config *cfg; /* borrowed */
	struct registry reg;
	struct stats stats;
	struct ulid_gen ulid;
	bool changed;             /* a mutation happened since the last dispatch_commit */
};

/* Seeds the id generator and hash key from the kernel's randomness. 0 or -errno. */
int dispatch_init(struct dispatch *d, const struct config *cfg);
/* Frees every conversation. */
void dispatch_free(struct dispatch *d);

/* Answers one request line (without its terminator) into out. Blank lines produce no
 * answer. Never fails: an allocation failure becomes an `internal` answer. */
void dispatch_line(struct dispatch *d, const char *line, size_t len, struct buf *out);

/* Answers a line that went over --max-line-bytes. */
void dispatch_too_large_line(struct dispatch *d, struct buf *out);

/* Makes the turn's mutations durable before their answers are written (the group-commit
 * step; the memory-only daemon has nothing to write yet). 0 or -errno. */
int dispatch_commit(struct dispatch *d);

/* Wall-clock Unix milliseconds. */
int64_t dispatch_now_ms(void);

#endif
