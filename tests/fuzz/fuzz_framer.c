/* Fuzz target for daemon/framer.c: the input picks a line limit and a chunking, then the rest
 * is fed to the framer in those chunks. The events must be exactly those of a simple model
 * that splits the whole stream at '\n' (chunking changes nothing), lines never exceed the
 * limit, buffered bytes stay under the limit plus one read, and every byte is accounted
 * for (returned, discarded or still pending at the end). */
#include <stdbool.h>
#include <string.h>

#include "framer.h"
#include "fuzz.h"
#include "ops.h"

/* One event of the model: a line [start, start+len) of the stream, or a too-large line. */
struct model_event {
	bool too_large;
	size_t start, len;
};

/* The model: every '\n'-terminated line gives one event, but an over-long blank one
 * (ops_text_blank of the whole line) none; the unterminated tail none, however long (an
 * unfinished request: it is discarded once it can no longer fit, over max_line + 1 bytes
 * or exactly that many without a trailing '\r'). Returns the count; *tail is the tail's
 * length and *tail_too_large whether it is being discarded. */
static size_t model_run(const uint8_t *s, size_t n, size_t max_line, struct model_event *ev,
                        size_t *tail, bool *tail_too_large)
{
	size_t nev = 0, start = 0;

	for (size_t i = 0; i < n; i++) {
		size_t len;
		if (s[i] != '\n')
			continue;
		len = i - start;
		if (len > 0 && s[i - 1] == '\r')
			len--;
		if (len <= max_line || !ops_text_blank((const char *)s + start, len)) {
			ev[nev].too_large = len > max_line;
			ev[nev].start = start;
			ev[nev].len = len;
			nev++;
		}
		start = i + 1;
	}
	*tail = n - start;
	*tail_too_large = *tail > max_line + 1 || (*tail == max_line + 1 && s[n - 1] != '\r');
	return nev;
}

/* xorshift32: chunk sizes from a seed taken from the input. */
static uint32_t next_rand(uint32_t *s)
{
	uint32_t x = *s;
	x ^= x << 13;
	x ^= x >> 17;
	x ^= x << 5;
	*s = x;
	return x;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct fuzz_in in = {data, size};
	uint16_t limit = fuzz_u16(&in), chunking = fuzz_u16(&in);
	/* Mostly small limits, so that long lines are common; the high bit asks for a large
	 * one, to grow the buffer past its first size. */
	size_t max_line = limit & 0x8000 ? (size_t)(limit & 0x7fff) * 4 : limit % 300;
	size_t max_chunk = chunking & 0x8000 ? 1 + (size_t)(chunking & 0x7fff) * 2
	                                     : 1 + (size_t)(chunking & 0xff) % 64;
	uint32_t seed = (uint32_t)chunking * 2654435761u | 1;
	const uint8_t *stream = in.p;
	size_t n = in.n, pos = 0, nev, tail, got = 0;
	struct model_event *ev = NULL;
	bool tail_too_large;
	struct framer f;

	ev = malloc((n + 1) * sizeof(*ev));
	if (!ev)
		return 0;
	nev = model_run(stream, n, max_line, ev, &tail, &tail_too_large);

	framer_init(&f, max_line);
	while (pos < n) {
		size_t chunk = 1 + next_rand(&seed) % max_chunk, room;
		char *buf;
		const char *line;
		size_t len;
		enum framer_event e;

		if (chunk > n - pos)
			chunk = n - pos;
		FUZZ_REQUIRE(framer_reserve(&f, chunk, &buf, &room) == 0, "reserve %zu failed",
		             chunk);
		FUZZ_REQUIRE(room >= chunk, "reserve gave %zu bytes for %zu", room, chunk);
		memcpy(buf, stream + pos, chunk);
		framer_commit(&f, chunk);
		pos += chunk;
		FUZZ_REQUIRE(framer_pending(&f) <= max_line + 1 + chunk,
		             "%zu bytes pending after a read of %zu (limit %zu)",
		             framer_pending(&f), chunk, max_line);
		while ((e = framer_next(&f, &line, &len)) != FRAMER_NONE) {
			FUZZ_REQUIRE(got < nev, "event %zu beyond the model's %zu", got, nev);
			FUZZ_REQUIRE(ev[got].too_large == (e == FRAMER_TOO_LARGE),
			             "event %zu: framer says %s, model %s", got,
			             e == FRAMER_TOO_LARGE ? "too large" : "line",
			             ev[got].too_large ? "too large" : "line");
			if (e == FRAMER_LINE) {
				FUZZ_REQUIRE(len <= max_line, "line of %zu bytes over %zu", len,
				             max_line);
				FUZZ_REQUIRE(len == ev[got].len &&
				                 memcmp(line, stream + ev[got].start, len) == 0,
				             "line %zu differs from the stream", got);
			}
			got++;
		}
		/* Between reads only an unfinished line is held, one byte over the limit at
		 * most (a '\r' that may start a "\r\n"). */
		FUZZ_REQUIRE(framer_pending(&f) <= max_line + 1, "%zu bytes held (limit %zu)",
		             framer_pending(&f), max_line);
		FUZZ_REQUIRE(f.cap <= 16384 + 2 * (max_line + 1 + max_chunk),
		             "buffer grew to %zu bytes (limit %zu, reads of %zu)", f.cap, max_line,
		             max_chunk);
	}
	FUZZ_REQUIRE(got == nev, "%zu events, the model has %zu", got, nev);
	/* Every byte is accounted for: lines handed out, or pending as the tail. */
	if (tail_too_large)
		FUZZ_REQUIRE(framer_pending(&f) == 0, "%zu bytes of a discarded line kept",
		             framer_pending(&f));
	else
		FUZZ_REQUIRE(framer_pending(&f) == tail, "%zu bytes pending, the tail is %zu",
		             framer_pending(&f), tail);
	framer_free(&f);
	free(ev);
	return 0;
}
