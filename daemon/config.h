/* The daemon's settings: defaults, the config file (convod.conf(5)), the command line on top
 * of it, --check-config's report, and what a reload (SIGHUP) may change while running. */
#ifndef CONVOD_CONFIG_H
#define CONVOD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "log.h"

#define CONFIG_ERR_SIZE 512
#define CONFIG_MAX_SETTINGS 40
#define CONFIG_MAX_FILE_BYTES (1024 * 1024)
#define CONFIG_MAX_LINE_BYTES 65536
#define CONFIG_MAX_IDS 4096 /* entries of allow-uids or allow-gids */

/* Where a setting's value came from. */
enum config_source { CONFIG_SRC_DEFAULT = 0, CONFIG_SRC_FILE, CONFIG_SRC_FLAG };

struct config {
	const char *socket_path; /* a literal or one of strs */
	const char *state_dir;
	size_t max_line_bytes;   /* a reload applies to connections opened after it */
	size_t max_output_bytes; /* queued output per connection before reading pauses */
	size_t max_connections;
	size_t max_conversations;
	size_t max_messages; /* per conversation */
	size_t max_conversation_bytes;
	size_t max_conversation_id_bytes;
	/* Peer allow-list (SO_PEERCRED at accept, read for every new connection, so a reload
	 * applies to the next one): when either list is non-empty, only a peer whose uid is in
	 * allow_uids or whose group is in allow_gids is served. Owned. */
	uid_t *allow_uids;
	size_t nallow_uids;
	gid_t *allow_gids;
	size_t nallow_gids;
	enum log_level log_level;
	enum log_format log_format; /* as configured (auto is resolved by log_set_format) */
	/* Persistence (persistence.md). */
	bool memory_only; /* no store at all: close forgets, restart loses everything */
	int durability;   /* enum durability of store.h */
	const char *dynamodb_table;
	uint64_t flush_interval_ms;
	uint64_t idle_ms; /* a conversation idle this long has its last message flushed */
	size_t batch_items;
	uint64_t retry_base_ms, retry_max_ms;
	size_t spool_max_items;
	uint32_t expires_days;          /* DynamoDB TTL attribute; 0 = none */
	uint32_t closed_retention_days; /* closed conversations kept in the local store */
	uint64_t drain_ms;              /* at shutdown, how long the flusher may keep sending */
	uint64_t connect_timeout_ms;    /* DynamoDB: connect (restart to change) */
	uint64_t request_timeout_ms;    /* DynamoDB: a whole request (restart to change) */
	bool create_table;
	bool ignore_crc32; /* DynamoDB: take answers that do not match x-amz-crc32 */

	/* Bookkeeping: per setting (in the order of config_setting_key), where its value came
	 * from and the file line (0 when not from the file); the file's path; the strings
	 * the settings point into (owned). */
	enum config_source source[CONFIG_MAX_SETTINGS];
	unsigned line[CONFIG_MAX_SETTINGS];
	char *file;
	char **strs;
	size_t nstrs;
};

/* Fills the defaults (allocates nothing; config_free is still fine to call). */
void config_defaults(struct config *cfg);
/* Frees what cfg owns and zeroes it; accepts NULL. */
void config_free(struct config *cfg);

enum config_action { CONFIG_RUN = 0, CONFIG_HELP, CONFIG_VERSION, CONFIG_CHECK };

/* One command-line setting, as given (key without "--"). */
struct config_flag {
	char *key; /* owned */
	char *value;
};

/* What the command line said: kept for the whole run so that a reload re-applies the flags
 * over the reloaded file. config_path is borrowed from argv. Free with config_args_free. */
struct config_args {
	enum config_action action;
	const char *config_path; /* NULL: no config file */
	struct config_flag *flags;
	size_t nflags;
};

/* Parses argv into args: the action, --config and every setting flag (checked here too:
 * an unknown flag, a missing or bad value). A repeated flag replaces the earlier one,
 * except --allow-uid/--allow-gid, whose lists add up. 0, or -EINVAL/-ENOMEM with err
 * saying what was wrong (args is then empty). */
int config_parse_args(struct config_args *args, int argc, char **argv, char *err, size_t errsize);
void config_args_free(struct config_args *args);

/* The effective settings: defaults, then the file args->config_path (if any), then the
 * flags, whatever their order on the command line; then the checks across settings.
 * cfg is initialised here (config_free it, also after a failure). 0, or -errno with err
 * naming the file, line and key (or the flag): -EINVAL for a bad file or value, -ENOENT
 * and other errors of reading the file, -EFBIG, -ENOMEM. */
int config_load(struct config *cfg, const struct config_args *args, char *err, size_t errsize);

/* Parses a config file's text (len bytes; name is used in messages) into cfg on top of
 * what it holds. 0 or -EINVAL/-ENOMEM with err set; cfg may then be half updated. */
int config_parse_text(struct config *cfg, const char *name, const char *text, size_t len, char *err,
                      size_t errsize);

/* Sets one setting from its text form. where prefixes error messages ("--max-line-bytes",
 * "file:12"); line is recorded for file settings. 0, or -ENOENT (unknown key), -EINVAL
 * (bad value) or -ENOMEM with err set. */
int config_set(struct config *cfg, const char *key, const char *value, enum config_source src,
               unsigned line, const char *where, char *err, size_t errsize);

/* Checks across settings (retry-max-ms >= retry-base-ms). 0 or -EINVAL with err set. */
int config_validate(const struct config *cfg, char *err, size_t errsize);

/* The key of setting i (file key, flag without "--"), NULL past the last; static. */
const char *config_setting_key(size_t i);
/* Index of a key, or -1. */
int config_setting_index(const char *key);
/* The value of setting i in the file's syntax (quoted when needed), into buf. Returns buf. */
const char *config_format_value(const struct config *cfg, size_t i, char *buf, size_t size);

/* Writes every setting, one per line, "key = value  # source", in a form config_parse_text
 * reads back. */
void config_print(const struct config *cfg, FILE *f);

struct awsconf;
/* --check-config's report of the AWS settings, as comment lines: region, endpoint, profile,
 * the access key id's last 4 characters, and only whether a secret key and a session token
 * are set. */
void config_print_aws(const struct awsconf *aws, FILE *f);

/* True when the allow-lists let a peer with that uid and gid in (always, when both
 * lists are empty). */
bool config_peer_allowed(const struct config *cfg, uid_t uid, gid_t gid);

/* What a reload changed that the caller must act on (config_reload's result). */
#define CONFIG_RELOAD_FLUSH_TIMER 1u /* flush_interval_ms: restart the timer */
#define CONFIG_RELOAD_SINK 2u        /* batch, retry, spool or expires settings: reconfigure */

/* A reload: moves every setting that may change at run time from next into running (log
 * level and format are applied at once), logs one line per changed setting ("config:
 * max-line-bytes 1048576 -> 2048") and one per changed setting that needs a restart
 * ("needs a restart; keeping ..."), which running keeps. next keeps what was not moved
 * and is still the caller's to free. Returns CONFIG_RELOAD_* bits. Loop thread only. */
unsigned config_reload(struct config *running, struct config *next);

/* Prints the usage text, every flag with its default. */
void config_usage(const char *prog);

#endif
