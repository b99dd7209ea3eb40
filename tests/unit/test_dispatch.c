/* The dispatcher's schedule of the retention purge (dispatch_flush_tick), over a real store
 * file: conversations closed longer than closed-retention-days ago leave the local store in
 * the first quiet flush tick (nothing committed since the tick before) once the purge is
 * due, a minute after the start and then hourly, or in any tick once it is an hour
 * overdue; never before it is due, never with the setting at 0, and never the open ones or
 * those closed within the retention. The purge itself (which rows go) is test_store's
 * test_purge; the daemon's clock cannot be moved from an integration test, so the due time
 * is moved here instead. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "buf.h"
#include "config.h"
#include "convo.h"
#include "dispatch.h"
#include "log.h"
#include "store.h"
#include "test.h"

#define DAY_MS INT64_C(86400000)
#define HOUR_MS INT64_C(3600000)

static struct store *s;
static struct dispatch d;
static struct buf out;

/* One request in a turn of its own, answered ok and committed. */
static void request(const char *line)
{
	out.len = 0;
	dispatch_line(&d, line, strlen(line), &out, NULL, DISPATCH_REMOTE_CHECK);
	CHECK(out.len > 0 && memmem(out.data, out.len, "\"ok\":true", 9) != NULL);
	CHECK(dispatch_commit(&d, false) == DISPATCH_COMMIT_SUBMITTED);
	CHECK(store_sync(s) == 0);
	dispatch_progress(&d);
	dispatch_turn_done(&d);
}

static void add(const char *conv)
{
	char line[256];
	snprintf(line, sizeof(line),
	         "{\"id\":1,\"op\":\"add_user\",\"conversation\":\"%s\",\"contents\":\"hi\"}",
	         conv);
	request(line);
}

static void close_conv(const char *conv)
{
	char line[256];
	snprintf(line, sizeof(line), "{\"id\":2,\"op\":\"close\",\"conversation\":\"%s\"}", conv);
	request(line);
}

static bool stored(const char *conv)
{
	struct convo *c = NULL;
	int rc = store_load_conversation(s, conv, strlen(conv), &c);
	CHECK(rc == 0 || rc == -ENOENT);
	convo_free(c);
	return rc == 0;
}

/* Moves conv's close in the store to days ago, in a transaction of the test's own. */
static void closed_ago(const char *conv, int64_t days)
{
	CHECK(store_begin(s) == 0);
	CHECK(store_set_closed(s, conv, strlen(conv), dispatch_now_ms() - days * DAY_MS) == 0);
	CHECK(store_commit(s) == 0);
}

/* One flush tick; returns what it logged. */
static char *tick(void)
{
	capture_begin();
	dispatch_flush_tick(&d, false);
	return capture_end();
}

/* Opens s, a store in a new directory dir (dir_size bytes): false when it cannot. */
static bool open_store(char *dir, size_t dir_size)
{
	const char *tmp = getenv("TMPDIR");
	char err[256];

	snprintf(dir, dir_size, "%s/test_dispatch.XXXXXX", tmp && *tmp ? tmp : "/tmp");
	CHECK(mkdtemp(dir) != NULL);
	CHECK(store_open(dir, DURABILITY_PROCESS, &s, err, sizeof(err)) == 0);
	return s != NULL;
}

/* Frees d and cfg, closes s and removes its directory. */
static void close_store(const char *dir, struct config *cfg)
{
	char path[300];

	CHECK(store_sync(s) == 0);
	buf_free(&out);
	dispatch_free(&d);
	config_free(cfg);
	store_close(s);
	snprintf(path, sizeof(path), "%s/convod.db", dir);
	CHECK(unlink(path) == 0);
	CHECK(rmdir(dir) == 0);
}

static void test_retention_schedule(void)
{
	char dir[256], *log;
	struct config cfg;
	int64_t due;

	if (!open_store(dir, sizeof(dir)))
		return;
	config_defaults(&cfg);
	cfg.closed_retention_days = 30;
	CHECK(dispatch_init(&d, &cfg, s, NULL) == 0);
	due = d.purge_due_ms;
	CHECK(due > dispatch_now_ms() + 50000 && due <= dispatch_now_ms() + 60000);
	for (int i = 0; i < 5; i++) {
		static const char *const convs[] = {"old", "old-busy", "recent", "open", "kept"};
		add(convs[i]);
	}
	close_conv("old");
	close_conv("old-busy");
	close_conv("recent");
	close_conv("kept");
	closed_ago("old", 31);
	closed_ago("old-busy", 31);
	closed_ago("recent", 29);

	/* Not due yet: quiet ticks leave everything. */
	free(tick());
	free(tick());
	CHECK(stored("old") && d.purge_due_ms == due);

	/* Due, but something was committed since the last tick: it waits for a quiet one. */
	d.purge_due_ms = dispatch_now_ms() - 1000;
	due = d.purge_due_ms;
	add("open");
	free(tick());
	CHECK(stored("old") && d.purge_due_ms == due);

	/* Due and quiet, but without DynamoDB the store holds the only copy: nothing goes. */
	CHECK(!d.purge_local);
	free(tick());
	CHECK(stored("old") && stored("old-busy") && d.purge_due_ms == due);
	d.purge_local = true; /* as with DynamoDB as the sink */

	/* Due and quiet: the old closed conversations go, nothing else, and the next purge is
	 * an hour away. */
	log = tick();
	CHECK(log && strstr(log, "removed 2 closed conversations past retention"));
	free(log);
	CHECK(!stored("old") && !stored("old-busy"));
	CHECK(stored("recent") && stored("open") && stored("kept"));
	CHECK(d.purge_due_ms > dispatch_now_ms() + HOUR_MS - 60000);

	/* An hour overdue: it runs in a busy tick too. */
	closed_ago("recent", 31);
	d.purge_due_ms = dispatch_now_ms() - HOUR_MS - 1000;
	add("open");
	log = tick();
	CHECK(log && strstr(log, "removed 1 closed conversations past retention"));
	free(log);
	CHECK(!stored("recent") && stored("open") && stored("kept"));

	/* closed-retention-days = 0 keeps them for ever. */
	closed_ago("kept", 3650);
	cfg.closed_retention_days = 0;
	d.purge_due_ms = dispatch_now_ms() - HOUR_MS - 1000;
	free(tick());
	free(tick());
	CHECK(stored("kept") && stored("open"));
	close_store(dir, &cfg);
}

static void *ready_waiter;
static enum dispatch_remote ready_outcome;
static int readies, soon_calls;

static void on_ready(void *waiter, enum dispatch_remote outcome)
{
	ready_waiter = waiter;
	ready_outcome = outcome;
	readies++;
}

static void retry_soon(void *arg)
{
	(void)arg;
	soon_calls++;
}

/* retry_dead_letters' move waits while the checkpoint thread is behind (the WAL past its
 * threshold and a round asked or running), but at most DISPATCH_RETRY_WAITS_MAX times in a
 * row: with the thread held for good (a disk too slow for it), the move still ends, one
 * part after each DISPATCH_RETRY_WAITS_MAX waits, and its client gets the whole count. */
static void test_retry_waits_capped(void)
{
	static const char line[] = "{\"id\":7,\"op\":\"retry_dead_letters\"}";
	char dir[256];
	size_t waits = 0, in_a_row = 0, most_in_a_row = 0, steps = 0;
	const size_t n = 4 * DISPATCH_RETRY_PART - 24, parts = 4;
	enum dispatch_retry r;
	struct config cfg;
	uint64_t items = 0, bytes = 0;
	int64_t oldest = 0;
	int waiter;

	if (!open_store(dir, sizeof(dir)))
		return;
	/* A round is asked past 8 WAL pages, never done; no hard bound in reach. */
	store_set_wal_pages(s, 8, 1 << 30, 0);
	store_hold_checkpoints(s, true);
	CHECK(store_begin(s) == 0);
	for (size_t i = 0; i < n; i++) {
		char conv[32];
		int len = snprintf(conv, sizeof(conv), "conv-%zu", i);
		CHECK(store_dead_letter(s, conv, (size_t)len, "01ARZ3NDEKTSV4RRFFQ69G5FB0", 1, NULL,
		                        "refused", dispatch_now_ms()) == 0);
	}
	CHECK(store_commit(s) == 0);

	config_defaults(&cfg);
	CHECK(dispatch_init(&d, &cfg, s, NULL) == 0);
	d.on_ready = on_ready;
	d.retry_soon = retry_soon;
	out.len = 0;
	CHECK(dispatch_line(&d, line, sizeof(line) - 1, &out, &waiter, DISPATCH_REMOTE_CHECK) ==
	      DISPATCH_WAIT);
	CHECK(out.len == 0 && soon_calls == 1 && readies == 0);
	do {
		size_t parts_before = d.retry_parts;
		r = dispatch_retry_step(&d);
		/* A step that wrote a part restarts the count, and may end in a wait. */
		if (d.retry_wait && d.retry_parts != parts_before)
			in_a_row = 0;
		in_a_row += r == DISPATCH_RETRY_WAIT;
		waits += r == DISPATCH_RETRY_WAIT;
		if (in_a_row > most_in_a_row)
			most_in_a_row = in_a_row;
	} while (r != DISPATCH_RETRY_DONE && ++steps < 100000);
	CHECK(r == DISPATCH_RETRY_DONE);
	/* Every part came after the longest wait allowed, and none sooner. */
	CHECK(most_in_a_row == DISPATCH_RETRY_WAITS_MAX);
	CHECK(waits == parts * DISPATCH_RETRY_WAITS_MAX);
	CHECK(d.retry_ended.moves == 1 && d.retry_ended.moved == n);
	CHECK(d.retry_ended.parts == parts && d.retry_ended.pauses == waits);
	CHECK(readies == 1 && ready_waiter == &waiter && ready_outcome == DISPATCH_REMOTE_ABSENT);
	/* The line again, as the server sends it once ready: the whole count. */
	out.len = 0;
	CHECK(dispatch_line(&d, line, sizeof(line) - 1, &out, &waiter, DISPATCH_REMOTE_ABSENT) ==
	      DISPATCH_DONE);
	CHECK(out.len > 0 && memmem(out.data, out.len, "\"retried\":1000", 14) != NULL);
	CHECK(store_spool_stats(s, &items, &bytes, &oldest) == 0 && items == n);

	store_hold_checkpoints(s, false);
	close_store(dir, &cfg);
}

int main(void)
{
	log_set_level(LOG_INFO);
	test_retention_schedule();
	test_retry_waits_capped();
	return test_done("dispatch");
}
