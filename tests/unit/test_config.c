/* Unit tests of daemon/config.c: the config file parser, the flags over the file, the
 * report of --check-config, the allow-list and what a reload applies. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "awsconf.h"
#include "config.h"
#include "log.h"
#include "store.h"
#include "test.h"

/* --- helpers ----------------------------------------------------------------------------- */

static char *write_temp(const char *text)
{
	char *path = strdup("/tmp/test_config_XXXXXX");
	int fd = mkstemp(path);
	size_t n = strlen(text);

	if (fd < 0 || write(fd, text, n) != (ssize_t)n) {
		fprintf(stderr, "cannot write a temporary file\n");
		exit(1);
	}
	close(fd);
	return path;
}

/* Parses text as a file; returns the result code, err filled. */
static int parse(struct config *cfg, const char *text, char *err)
{
	config_defaults(cfg);
	err[0] = '\0';
	return config_parse_text(cfg, "test.conf", text, strlen(text), err, CONFIG_ERR_SIZE);
}

/* config_parse_args over a NULL-terminated list (copied: getopt permutes argv). */
static int parse_argv(struct config_args *args, const char *const *list, char *err)
{
	char *argv[64];
	int argc = 0, rc;

	while (list[argc]) {
		argv[argc] = (char *)list[argc];
		argc++;
	}
	argv[argc] = NULL;
	err[0] = '\0';
	rc = config_parse_args(args, argc, argv, err, CONFIG_ERR_SIZE);
	return rc;
}

static int idx(const char *key)
{
	return config_setting_index(key);
}

/* --- the file ------------------------------------------------------------------------------ */

static void test_defaults(void)
{
	struct config c;
	char buf[64];

	config_defaults(&c);
	CHECK_STR(c.socket_path, "/run/convod/convod.sock");
	CHECK_STR(c.state_dir, "/var/lib/convod");
	CHECK(c.max_line_bytes == 1048576);
	CHECK(c.max_output_bytes == 8388608);
	CHECK(c.max_connections == 1024);
	CHECK(c.max_messages == 100000);
	CHECK(c.log_level == LOG_INFO);
	CHECK(c.log_format == LOG_FORMAT_AUTO);
	CHECK(c.durability == DURABILITY_PROCESS);
	CHECK(c.nallow_uids == 0 && c.allow_uids == NULL);
	CHECK(!c.memory_only && !c.create_table);
	for (size_t i = 0; config_setting_key(i); i++)
		CHECK(c.source[i] == CONFIG_SRC_DEFAULT);
	CHECK_STR(config_format_value(&c, (size_t)idx("max-line-bytes"), buf, sizeof(buf)),
	          "1048576");
	CHECK_STR(config_format_value(&c, (size_t)idx("durability"), buf, sizeof(buf)), "process");
	CHECK_STR(config_format_value(&c, (size_t)idx("allow-uids"), buf, sizeof(buf)), "");
	CHECK(idx("no-such-key") == -1);
	/* Every flag of the old command line is a key. */
	CHECK(idx("max-conversation-id-bytes") >= 0 && idx("drain-ms") >= 0 &&
	      idx("closed-retention-days") >= 0 && idx("create-table") >= 0 &&
	      idx("flush-interval") >= 0 && idx("log-format") >= 0 && idx("allow-gids") >= 0);
	config_free(&c);
}

static void test_good_file(void)
{
	struct config c;
	char err[CONFIG_ERR_SIZE];
	const char *text = "\xef\xbb\xbf# a comment\n"
	                   "\n"
	                   "   # an indented comment\n"
	                   "max-line-bytes = 2048\n"
	                   "max-messages=7\r\n"
	                   "\tmax-connections\t=\t3   # trailing comment\n"
	                   "socket = \"/tmp/with #hash.sock\"\n"
	                   "state-dir = /var/lib/x#y\n"
	                   "memory-only = true\n"
	                   "create-table = false\n"
	                   "log-level = debug\n"
	                   "log-format = journal\n"
	                   "durability = machine\n"
	                   "dynamodb-table = my.table-1\n"
	                   "allow-uids = 0, 1000 ,root\n"
	                   "allow-gids =\n"
	                   "flush-interval = 250\n"
	                   "idle-ms = 0\n"
	                   "batch-items = 10\n"
	                   "retry-base-ms = 50\n"
	                   "retry-max-ms = 60000\n"
	                   "spool-max-items = 5\n"
	                   "expires-days = 7\n"
	                   "closed-retention-days = 0\n"
	                   "drain-ms = 0\n"
	                   "max-output-bytes = 1024\n"
	                   "max-conversations = 9\n"
	                   "max-conversation-bytes = 100\n"
	                   "max-conversation-id-bytes = 12"; /* no final newline */

	CHECK(parse(&c, text, err) == 0);
	CHECK_STR(err, "");
	CHECK(c.max_line_bytes == 2048);
	CHECK(c.max_messages == 7);
	CHECK(c.max_connections == 3);
	CHECK_STR(c.socket_path, "/tmp/with #hash.sock");
	CHECK_STR(c.state_dir, "/var/lib/x#y");
	CHECK(c.memory_only && !c.create_table);
	CHECK(c.log_level == LOG_DEBUG);
	CHECK(c.log_format == LOG_FORMAT_JOURNAL);
	CHECK(c.durability == DURABILITY_MACHINE);
	CHECK_STR(c.dynamodb_table, "my.table-1");
	CHECK(c.nallow_uids == 3 && c.allow_uids[0] == 0 && c.allow_uids[1] == 1000 &&
	      c.allow_uids[2] == 0);
	CHECK(c.nallow_gids == 0);
	CHECK(c.flush_interval_ms == 250 && c.idle_ms == 0 && c.batch_items == 10);
	CHECK(c.retry_base_ms == 50 && c.retry_max_ms == 60000 && c.spool_max_items == 5);
	CHECK(c.expires_days == 7 && c.closed_retention_days == 0 && c.drain_ms == 0);
	CHECK(c.max_output_bytes == 1024 && c.max_conversations == 9 &&
	      c.max_conversation_bytes == 100 && c.max_conversation_id_bytes == 12);
	CHECK(c.source[idx("max-line-bytes")] == CONFIG_SRC_FILE);
	CHECK(c.line[idx("max-line-bytes")] == 4);
	CHECK(c.line[idx("max-conversation-id-bytes")] == 29);
	CHECK(c.source[idx("allow-gids")] == CONFIG_SRC_FILE);
	config_free(&c);

	/* An empty file and a comments-only file change nothing. */
	CHECK(parse(&c, "", err) == 0);
	CHECK(c.max_line_bytes == 1048576);
	config_free(&c);
	CHECK(parse(&c, "# nothing\n\n  \n", err) == 0);
	CHECK(c.source[idx("socket")] == CONFIG_SRC_DEFAULT);
	config_free(&c);
}

struct bad_case {
	const char *text;
	const char *expect[3]; /* substrings of the message */
};

static void test_bad_files(void)
{
	static const struct bad_case cases[] = {
	    {"max-line-bytes = 2048\nbogus-key = 1\n", {"test.conf:2:", "bogus-key", "unknown"}},
	    {"max-line-bytes = abc\n", {"test.conf:1:", "max-line-bytes", "'abc'"}},
	    {"max-line-bytes = 63\n", {"test.conf:1:", "max-line-bytes", ">= 64"}},
	    {"max-line-bytes = -5\n", {":1:", "max-line-bytes", "'-5'"}},
	    {"max-line-bytes = 12x\n", {":1:", "max-line-bytes", "'12x'"}},
	    {"max-line-bytes = 1.5\n", {":1:", "max-line-bytes", NULL}},
	    {"max-line-bytes = 99999999999999999999999\n", {":1:", "max-line-bytes", NULL}},
	    {"max-line-bytes =\n", {":1:", "max-line-bytes", NULL}},
	    {"# c\nmax-messages = 5\n\nmax-messages = 6\n",
	     {"test.conf:4:", "max-messages", "duplicate key (first set on line 2)"}},
	    {"memory-only = yes\n", {":1:", "memory-only", "true or false"}},
	    {"log-level = loud\n", {":1:", "log-level", "'loud'"}},
	    {"log-format = syslog\n", {":1:", "log-format", "'syslog'"}},
	    {"durability = disk\n", {":1:", "durability", "'disk'"}},
	    {"batch-items = 26\n", {":1:", "batch-items", "from 1 to 25"}},
	    {"flush-interval = 0\n", {":1:", "flush-interval", NULL}},
	    {"expires-days = 36501\n", {":1:", "expires-days", NULL}},
	    {"socket =\n", {":1:", "socket", "expected a value"}},
	    {"socket = \"\"\n", {":1:", "socket", "expected a value"}},
	    {"dynamodb-table = a b c\n", {":1:", "dynamodb-table", NULL}},
	    {"dynamodb-table = ab\n", {":1:", "dynamodb-table", NULL}},
	    {"max-line-bytes 2048\n", {":1:", "max-line-bytes", "expected '='"}},
	    {"just some words\n", {":1:", "expected", NULL}},
	    {"= 5\n", {":1:", "expected 'key = value'", NULL}},
	    {"Max-Line-Bytes = 5\n", {":1:", "expected 'key = value'", NULL}},
	    {"allow-uids = 1,,2\n", {":1:", "allow-uids", "empty entry"}},
	    {"allow-uids = 1,\n", {":1:", "allow-uids", "empty entry"}},
	    {"allow-uids = no-such-user-xyzzy\n", {":1:", "allow-uids", "unknown user"}},
	    {"allow-gids = no-such-group-xyzzy\n", {":1:", "allow-gids", "unknown group"}},
	    {"allow-uids = 4294967295\n", {":1:", "allow-uids", "not a valid user id"}},
	    {"allow-uids = 99999999999\n", {":1:", "allow-uids", "not a valid user id"}},
	    {"socket = /tmp/"
	     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	     "a"
	     "aaaaaaaaaaaaaaaaaaaaaaaaaa.sock\n",
	     {":1:", "socket", "at most 107 bytes"}},
	    {"log-level = info\x01\n", {":1:", "log-level", "control character"}},
	};
	struct config c;
	char err[CONFIG_ERR_SIZE];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int rc = parse(&c, cases[i].text, err);
		CHECK(rc == -EINVAL);
		for (size_t k = 0; k < 3 && cases[i].expect[k]; k++) {
			if (!strstr(err, cases[i].expect[k])) {
				fprintf(stderr, "case %zu: '%s' not in '%s'\n", i,
				        cases[i].expect[k], err);
				CHECK(0);
			}
		}
		config_free(&c);
	}

	/* A NUL byte, and an overlong line. */
	{
		static const char nul[] = "max-messages = 5\nlog-level = in\0fo\n";
		config_defaults(&c);
		CHECK(config_parse_text(&c, "n.conf", nul, sizeof(nul) - 1, err, sizeof(err)) ==
		      -EINVAL);
		CHECK(strstr(err, "n.conf:2:") && strstr(err, "NUL"));
		config_free(&c);
	}
	{
		size_t n = CONFIG_MAX_LINE_BYTES + 20;
		char *big = malloc(n + 1);
		memset(big, ' ', n);
		memcpy(big + n - 5, "x = 1", 5);
		big[n] = '\0';
		CHECK(parse(&c, big, err) == -EINVAL);
		CHECK(strstr(err, "test.conf:1:") && strstr(err, "longer than"));
		config_free(&c);
		free(big);
	}
}

/* --- the command line and precedence ------------------------------------------------------ */

static void test_args(void)
{
	struct config_args a;
	char err[CONFIG_ERR_SIZE];

	{
		const char *argv[] = {"convod", NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(a.action == CONFIG_RUN && a.config_path == NULL && a.nflags == 0);
		config_args_free(&a);
	}
	{
		const char *argv[] = {"convod",
		                      "--max-messages",
		                      "9",
		                      "--config",
		                      "/x.conf",
		                      "--check-config",
		                      "--memory-only",
		                      "--create-table=false",
		                      "--allow-uid",
		                      "1,2",
		                      "--allow-uid=3",
		                      "--allow-gids",
		                      "0",
		                      "--max-messages=10",
		                      NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(a.action == CONFIG_CHECK);
		CHECK_STR(a.config_path, "/x.conf");
		CHECK(a.nflags == 5);
		for (size_t i = 0; i < a.nflags; i++) {
			const char *k = a.flags[i].key, *v = a.flags[i].value;
			if (strcmp(k, "max-messages") == 0)
				CHECK_STR(v, "10"); /* the later one */
			else if (strcmp(k, "memory-only") == 0)
				CHECK_STR(v, "true");
			else if (strcmp(k, "create-table") == 0)
				CHECK_STR(v, "false");
			else if (strcmp(k, "allow-uids") == 0)
				CHECK_STR(v, "1,2,3"); /* lists add up */
			else if (strcmp(k, "allow-gids") == 0)
				CHECK_STR(v, "0");
			else
				CHECK(0);
		}
		config_args_free(&a);
	}
	{
		const char *argv[] = {"convod", "--help", "--version", NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(a.action == CONFIG_HELP);
		config_args_free(&a);
	}
	{
		struct {
			const char *argv[4];
			const char *expect;
		} bad[] = {
		    {{"convod", "--no-such-flag", NULL}, "--no-such-flag"},
		    {{"convod", "--max-messages", NULL}, "--max-messages: missing value"},
		    {{"convod", "--max-messages", "x", NULL}, "--max-messages: expected"},
		    {{"convod", "--memory-only=maybe", NULL}, "--memory-only: expected true"},
		    {{"convod", "--config", "", NULL}, "--config"},
		    {{"convod", "stray", NULL}, "stray"},
		    {{"convod", "--allow-uid", "nobody-xyzzy-none", NULL}, "unknown user"},
		    {{"convod", "--log-format", "xml", NULL}, "--log-format"},
		};
		for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
			CHECK(parse_argv(&a, bad[i].argv, err) == -EINVAL);
			if (!strstr(err, bad[i].expect)) {
				fprintf(stderr, "bad args %zu: '%s' not in '%s'\n", i,
				        bad[i].expect, err);
				CHECK(0);
			}
			CHECK(a.nflags == 0 && a.flags == NULL);
			config_args_free(&a);
		}
	}
}

static void test_precedence(void)
{
	char *path = write_temp("max-messages = 5\n"
	                        "max-connections = 7\n"
	                        "memory-only = true\n"
	                        "allow-uids = 1,2\n"
	                        "log-level = warn\n");
	struct config_args a;
	struct config c;
	char err[CONFIG_ERR_SIZE];

	{
		/* The flag comes before --config on the command line and still wins. */
		const char *argv[] = {
		    "convod", "--max-messages", "50", "--memory-only=false", "--allow-uid",
		    "",       "--config",       path, "--log-level",         "error",
		    NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(config_load(&c, &a, err, sizeof(err)) == 0);
		CHECK(c.max_messages == 50);
		CHECK(c.source[idx("max-messages")] == CONFIG_SRC_FLAG);
		CHECK(c.max_connections == 7);
		CHECK(c.source[idx("max-connections")] == CONFIG_SRC_FILE);
		CHECK(c.line[idx("max-connections")] == 2);
		CHECK(!c.memory_only);
		CHECK(c.nallow_uids == 0); /* an empty flag clears the file's list */
		CHECK(c.log_level == LOG_ERROR);
		CHECK(c.max_line_bytes == 1048576);
		CHECK(c.source[idx("max-line-bytes")] == CONFIG_SRC_DEFAULT);
		CHECK_STR(c.file, path);
		config_free(&c);
		config_args_free(&a);
	}
	{
		/* A missing file. */
		const char *argv[] = {"convod", "--config", "/nonexistent/convod.conf", NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(config_load(&c, &a, err, sizeof(err)) == -ENOENT);
		CHECK(strstr(err, "/nonexistent/convod.conf") != NULL);
		config_free(&c);
		config_args_free(&a);
	}
	{
		/* A directory. */
		const char *argv[] = {"convod", "--config", "/tmp", NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(config_load(&c, &a, err, sizeof(err)) < 0);
		CHECK(strstr(err, "/tmp") != NULL);
		config_free(&c);
		config_args_free(&a);
	}
	{
		/* Across settings: a flag breaking what the file set is blamed on the flag. */
		const char *argv[] = {"convod", "--config",        path, "--retry-max-ms",
		                      "10",     "--retry-base-ms", "20", NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(config_load(&c, &a, err, sizeof(err)) == -EINVAL);
		CHECK(strstr(err, "retry-max-ms (10) must be at least retry-base-ms (20)") != NULL);
		config_free(&c);
		config_args_free(&a);
	}
	unlink(path);
	free(path);
	{
		char *p2 = write_temp("retry-base-ms = 500\nretry-max-ms = 400\n");
		const char *argv[] = {"convod", "--config", p2, NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(config_load(&c, &a, err, sizeof(err)) == -EINVAL);
		CHECK(strstr(err, p2) && strstr(err, ":2: retry-max-ms"));
		config_free(&c);
		config_args_free(&a);
		unlink(p2);
		free(p2);
	}
	{
		/* A bad file stays bad whatever the flags say about other keys. */
		char *p3 = write_temp("max-messages = 5\nmax-messages = 6\n");
		const char *argv[] = {"convod", "--config", p3, "--max-messages", "9", NULL};
		CHECK(parse_argv(&a, argv, err) == 0);
		CHECK(config_load(&c, &a, err, sizeof(err)) == -EINVAL);
		CHECK(strstr(err, "duplicate") != NULL);
		config_free(&c);
		config_args_free(&a);
		unlink(p3);
		free(p3);
	}
}

/* What config_print writes, read back, gives the same settings. */
static void test_print_roundtrip(void)
{
	struct config c, back;
	char err[CONFIG_ERR_SIZE], a[512], b[512];
	char *text = NULL;
	size_t len = 0;
	FILE *f;

	CHECK(parse(&c,
	            "socket = \" /tmp/lead space #x\"\nmax-messages = 12\nallow-uids = 5,6\n"
	            "allow-gids = 0\nlog-format = plain\ncreate-table = true\n",
	            err) == 0);
	CHECK(config_set(&c, "state-dir", "/s", CONFIG_SRC_FLAG, 0, "--state-dir", err,
	                 sizeof(err)) == 0);
	f = open_memstream(&text, &len);
	config_print(&c, f);
	fclose(f);
	CHECK(strstr(text, "max-messages = 12") != NULL);
	CHECK(strstr(text, "allow-uids = 5,6") != NULL);
	CHECK(strstr(text, "# file (line 2)") != NULL);
	CHECK(strstr(text, "# flag") != NULL);
	CHECK(strstr(text, "# default") != NULL);
	/* One line per setting (plus the heading). */
	{
		size_t lines = 0, n = 0;
		for (const char *p = text; *p; p++)
			lines += *p == '\n';
		while (config_setting_key(n))
			n++;
		CHECK(lines == n + 1);
	}
	config_defaults(&back);
	CHECK(config_parse_text(&back, "printed", text, len, err, sizeof(err)) == 0);
	for (size_t i = 0; config_setting_key(i); i++) {
		CHECK_STR(config_format_value(&back, i, a, sizeof(a)),
		          config_format_value(&c, i, b, sizeof(b)));
	}
	CHECK_STR(back.socket_path, " /tmp/lead space #x");
	free(text);
	config_free(&back);
	config_free(&c);
}

static void test_print_aws(void)
{
	char id[] = "AKIAEXAMPLEWXYZ", secret[] = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRET",
	     token[] = "FwoGZXIvYXdzTOKENVALUE", region[] = "eu-west-1";
	struct awsconf aws;
	char *text = NULL;
	size_t len = 0;
	FILE *f;

	memset(&aws, 0, sizeof(aws));
	aws.access_key_id = id;
	aws.secret_access_key = secret;
	aws.session_token = token;
	aws.region = region;
	aws.region_source = AWSCONF_ENV;
	aws.credentials_source = AWSCONF_ENV;
	f = open_memstream(&text, &len);
	config_print_aws(&aws, f);
	fclose(f);
	CHECK(strstr(text, "****WXYZ") != NULL);
	CHECK(strstr(text, "AKIAEXAMPLE") == NULL);
	CHECK(strstr(text, "SECRET") == NULL);
	CHECK(strstr(text, "TOKEN") == NULL);
	CHECK(strstr(text, "secret-access-key = (set)") != NULL);
	CHECK(strstr(text, "session-token = (set)") != NULL);
	CHECK(strstr(text, "eu-west-1") != NULL);
	free(text);

	memset(&aws, 0, sizeof(aws));
	text = NULL;
	f = open_memstream(&text, &len);
	config_print_aws(&aws, f);
	fclose(f);
	CHECK(strstr(text, "secret-access-key = (unset)") != NULL);
	CHECK(strstr(text, "session-token = (unset)") != NULL);
	CHECK(strstr(text, "not configured") != NULL);
	free(text);
}

static void test_peer_allowed(void)
{
	struct config c;
	char err[CONFIG_ERR_SIZE];

	config_defaults(&c);
	CHECK(config_peer_allowed(&c, 1234, 1234)); /* no list: everybody */
	CHECK(config_set(&c, "allow-uids", "1000,1001", CONFIG_SRC_FLAG, 0, "--allow-uid", err,
	                 sizeof(err)) == 0);
	CHECK(config_peer_allowed(&c, 1000, 5));
	CHECK(config_peer_allowed(&c, 1001, 5));
	CHECK(!config_peer_allowed(&c, 0, 0)); /* root too must be listed */
	CHECK(config_set(&c, "allow-gids", "50", CONFIG_SRC_FLAG, 0, "--allow-gid", err,
	                 sizeof(err)) == 0);
	CHECK(config_peer_allowed(&c, 7, 50));
	CHECK(!config_peer_allowed(&c, 7, 51));
	CHECK(config_set(&c, "allow-uids", "", CONFIG_SRC_FLAG, 0, "--allow-uid", err,
	                 sizeof(err)) == 0);
	CHECK(c.nallow_uids == 0 && c.allow_uids == NULL);
	CHECK(!config_peer_allowed(&c, 1000, 5)); /* only the group list is left */
	CHECK(config_peer_allowed(&c, 1000, 50));
	config_free(&c);
}

/* --- reload -------------------------------------------------------------------------------- */

static void test_reload(void)
{
	struct config run, next;
	char err[CONFIG_ERR_SIZE];
	const char *sock;
	unsigned bits;
	char *out;

	log_set_level(LOG_INFO);
	log_set_format(LOG_FORMAT_PLAIN);
	CHECK(parse(&run, "socket = /tmp/a.sock\nmax-line-bytes = 1048576\nallow-uids = 1\n",
	            err) == 0);
	sock = run.socket_path;
	CHECK(parse(&next,
	            "socket = /tmp/b.sock\nmax-line-bytes = 2048\nallow-uids = 1,2\n"
	            "max-messages = 3\nflush-interval = 50\nbatch-items = 5\nlog-format = journal\n"
	            "durability = none\n",
	            err) == 0);
	capture_begin();
	bits = config_reload(&run, &next);
	out = capture_end();
	/* Applied, with one line each. */
	CHECK(run.max_line_bytes == 2048);
	CHECK(run.max_messages == 3);
	CHECK(run.flush_interval_ms == 50);
	CHECK(run.batch_items == 5);
	CHECK(run.nallow_uids == 2 && run.allow_uids[1] == 2);
	CHECK(run.source[idx("max-messages")] == CONFIG_SRC_FILE);
	CHECK(run.log_format == LOG_FORMAT_JOURNAL);
	CHECK(log_get_format() == LOG_FORMAT_JOURNAL);
	CHECK(strstr(out, "config: max-line-bytes 1048576 -> 2048") != NULL);
	CHECK(strstr(out, "config: max-messages 100000 -> 3") != NULL);
	CHECK(strstr(out, "config: allow-uids 1 -> 1,2") != NULL);
	CHECK(strstr(out, "config: log-format auto -> journal") != NULL);
	/* The report is in the new format already. */
	CHECK(strstr(out, "<6>info config: max-messages") != NULL);
	/* Kept until a restart, and said so. */
	CHECK(run.socket_path == sock);
	CHECK_STR(run.socket_path, "/tmp/a.sock");
	CHECK(run.durability == DURABILITY_PROCESS);
	CHECK(strstr(out, "socket changed to /tmp/b.sock; needs a restart; keeping /tmp/a.sock") !=
	      NULL);
	CHECK(strstr(out, "durability changed to none; needs a restart; keeping process") != NULL);
	/* Unchanged settings are not mentioned. */
	CHECK(strstr(out, "max-connections") == NULL);
	CHECK(strstr(out, "state-dir") == NULL);
	CHECK(bits == (CONFIG_RELOAD_FLUSH_TIMER | CONFIG_RELOAD_SINK));
	free(out);
	config_free(&next); /* holds the old allow-list now */

	/* The same again: nothing changes. */
	CHECK(
	    parse(&next,
	          "socket = /tmp/a.sock\nmax-line-bytes = 2048\nallow-uids = 1,2\n"
	          "max-messages = 3\nflush-interval = 50\nbatch-items = 5\nlog-format = journal\n",
	          err) == 0);
	capture_begin();
	bits = config_reload(&run, &next);
	out = capture_end();
	CHECK(bits == 0);
	CHECK(strstr(out, "->") == NULL && strstr(out, "restart") == NULL);
	CHECK(strstr(out, "reloaded: 0 settings changed") != NULL);
	free(out);
	config_free(&next);

	/* More changes than the rate limit lets through: every one is reported. */
	CHECK(parse(&next,
	            "socket = /tmp/a.sock\nmax-line-bytes = 4096\nmax-output-bytes = 4096\n"
	            "max-connections = 4\nmax-conversations = 4\nmax-messages = 4\n"
	            "max-conversation-bytes = 4\nmax-conversation-id-bytes = 4\nidle-ms = 4\n"
	            "batch-items = 4\nretry-base-ms = 4\nretry-max-ms = 4\nspool-max-items = 4\n"
	            "expires-days = 4\nclosed-retention-days = 4\ndrain-ms = 4\n"
	            "log-format = plain\n",
	            err) == 0);
	capture_begin();
	config_reload(&run, &next);
	out = capture_end();
	CHECK(strstr(out, "drain-ms 5000 -> 4") != NULL);
	CHECK(strstr(out, "closed-retention-days 30 -> 4") != NULL);
	CHECK(strstr(out, "suppressed") == NULL);
	CHECK(run.drain_ms == 4 && run.max_conversation_id_bytes == 4);
	free(out);
	config_free(&next);
	config_free(&run);
	log_set_format(LOG_FORMAT_PLAIN);
}

int main(void)
{
	test_defaults();
	test_good_file();
	test_bad_files();
	test_args();
	test_precedence();
	test_print_roundtrip();
	test_print_aws();
	test_peer_allowed();
	test_reload();
	return test_done("config");
}
