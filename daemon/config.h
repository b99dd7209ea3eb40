/* The daemon's settings: defaults and the command line. */
#ifndef CONVOD_CONFIG_H
#define CONVOD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"

struct config {
	const char *socket_path;     /* borrowed from argv or a literal */
	const char *state_dir;
	size_t max_line_bytes;
	size_t max_output_bytes;     /* queued output per connection before reading pauses */
	size_t max_connections;
	size_t max_conversations;
	size_t max_messages;         /* per conversation */
	size_t max_conversation_bytes;
	size_t max_conversation_id_bytes;
	enum log_level log_level;
	/* Persistence (persistence.md). */
	bool memory_only;            /* no store at all: close forgets, restart loses everything */
	int durability;              /* enum durability of store.h */
	const char *dynamodb_table;
	uint64_t flush_interval_ms;
	uint64_t idle_ms;            /* a conversation idle this long has its last message flushed */
	size_t batch_items;
	uint64_t retry_base_ms, retry_max_ms;
	size_t spool_max_items;
	uint32_t expires_days;       /* DynamoDB TTL attribute; 0 = none */
	uint32_t closed_retention_days; /* closed conversations kept in the local store */
	uint64_t drain_ms;           /* at shutdown, how long the flusher may keep sending */
	bool create_table;
};

/* Fills the defaults. */
void config_defaults(struct config *cfg);

enum config_action { CONFIG_RUN = 0, CONFIG_HELP, CONFIG_VERSION };

/* Parses argv into cfg (strings borrowed from argv). Returns 0 and the action, or -EINVAL
 * after printing what was wrong to stderr. */
int config_parse_args(struct config *cfg, int argc, char **argv, enum config_action *action);

/* Prints the usage text, every flag with its default. */
void config_usage(const char *prog);

#endif
