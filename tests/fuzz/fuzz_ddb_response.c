/* Fuzz target for the DynamoDB answer parsers of lib/ddbitem.h: the input is an HTTP body as
 * DynamoDB might send it. Every parser must answer an error or a result without crashing;
 * an item that reads back as a message map must survive a round trip through the codec
 * unchanged, and a Query page that restores must give a conversation that passes
 * convo_check (the restore path of daemon/dispatch.c). */
#include <string.h>

#include "convo.h"
#include "ddbitem.h"
#include "fuzz.h"
#include "message.h"

/* An item read back: its map written again and read again must give the same map. */
static void check_item(const json_t *item)
{
	struct error err = {ERR_OK, ""};
	const char *conv = NULL, *conv2 = NULL;
	json_t *map = NULL, *item2 = NULL, *map2 = NULL;
	uint32_t version = 0, version2 = 0;
	int64_t updated = 0, updated2 = 0;
	struct message *m = NULL;
	enum error_code rc;
	size_t size = 0;
	int depth = 0;

	/* Measuring must not crash, whatever the item (their use is checked by test_ddbitem). */
	(void)ddbitem_size(item, &size);
	(void)ddbitem_depth(item, &depth);
	rc = ddbitem_to_map(item, &conv, &map, &version, &updated, &err);
	FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_BAD_REQUEST, "ddbitem_to_map: %s: %s",
	             error_code_str(rc), err.message);
	if (rc != ERR_OK)
		return;
	FUZZ_REQUIRE(map && conv && version >= 1, "ddbitem_to_map succeeded without a result");
	rc = ddbitem_from_map(conv, map, version, updated, 0, &item2, &err);
	FUZZ_REQUIRE(rc == ERR_OK, "a map read from an item cannot be written back: %s: %s",
	             error_code_str(rc), err.message);
	rc = ddbitem_to_map(item2, &conv2, &map2, &version2, &updated2, &err);
	FUZZ_REQUIRE(rc == ERR_OK, "an item written by the codec cannot be read: %s: %s",
	             error_code_str(rc), err.message);
	FUZZ_REQUIRE(json_equal(map, map2), "the map changed in a round trip");
	FUZZ_REQUIRE(strcmp(conv, conv2) == 0 && version == version2 && updated == updated2,
	             "the key, version or updated changed in a round trip");
	{
		/* What the codec writes, DynamoDB sends back as is in a Query answer: the
		 * parser must take it. */
		json_t *page = json_pack("{s:[O], s:i}", "Items", item2, "Count", 1), *items = NULL,
		       *last = NULL;
		char *body = json_dumps(page, JSON_COMPACT);
		FUZZ_REQUIRE(body, "cannot dump a Query answer");
		rc = ddbitem_query_parse(body, strlen(body), &items, &last, &err);
		FUZZ_REQUIRE(rc == ERR_OK,
		             "a Query answer holding an item the codec wrote is "
		             "refused: %s",
		             err.message);
		json_decref(items);
		json_decref(last);
		free(body);
		json_decref(page);
	}
	/* What a restore does next: the map must make a message, or be refused cleanly. */
	rc = message_from_map(map, version, &m, &err);
	FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_BAD_REQUEST, "message_from_map: %s: %s",
	             error_code_str(rc), err.message);
	if (rc == ERR_OK) {
		/* The message keeps the id, role and contents as they were; its metadata may
		 * be put in canonical form (an empty aux dropped), which then holds. */
		json_t *back = message_to_map(m), *again = NULL;
		struct message *m2 = NULL;
		FUZZ_REQUIRE(back, "message_to_map failed");
		FUZZ_REQUIRE(json_equal(json_object_get(back, "id"), json_object_get(map, "id")) &&
		                 json_equal(json_object_get(back, "message"),
		                            json_object_get(map, "message")),
		             "a message does not keep its id, role or contents");
		rc = message_from_map(back, version, &m2, &err);
		FUZZ_REQUIRE(rc == ERR_OK, "a message's own map is refused: %s", err.message);
		again = message_to_map(m2);
		FUZZ_REQUIRE(json_equal(again, back), "a message's map is not stable");
		message_free(m2);
		json_decref(again);
		json_decref(back);
	}
	message_free(m);
	json_decref(map);
	json_decref(map2);
	json_decref(item2);
}

/* A Query page restored as dispatch.c's convo_from_items does. */
static void restore_items(const json_t *items)
{
	struct convo *c = convo_new("fuzz", 4);
	struct error err = {ERR_OK, ""};
	const json_t *item;
	enum error_code rc;
	size_t i;

	if (!c)
		return;
	json_array_foreach(items, i, item)
	{
		json_t *map = NULL;
		struct message *m = NULL;
		uint32_t version = 0;
		int64_t updated = 0;

		check_item(item);
		if (ddbitem_to_map(item, NULL, &map, &version, &updated, &err) != ERR_OK ||
		    message_from_map(map, version, &m, &err) != ERR_OK) {
			json_decref(map);
			goto out;
		}
		json_decref(map);
		m->updated_ms = updated;
		m->seen[CONSUMER_SINK] = version;
		if (convo_restore_append(c, m) < 0)
			goto out;
	}
	rc = convo_restore_finish(c, &err);
	if (rc == ERR_OK) {
		rc = convo_check(c, &err);
		FUZZ_REQUIRE(rc == ERR_OK, "a restored conversation breaks an invariant: %s",
		             err.message);
	}
out:
	convo_free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *body = (const char *)data;
	struct error err = {ERR_OK, ""};
	json_t *unprocessed = NULL, *items = NULL, *last_key = NULL, *root;
	char type[64], message[128];
	enum error_code rc;
	json_error_t jerr;

	rc = ddbitem_batch_write_parse(body, size, "convod", &unprocessed, &err);
	FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_BAD_REQUEST, "batch_write_parse: %s",
	             error_code_str(rc));
	if (rc == ERR_OK) {
		const json_t *it;
		size_t i;
		FUZZ_REQUIRE(json_is_array(unprocessed), "unprocessed is not an array");
		json_array_foreach(unprocessed, i, it)
		{
			const char *conv, *sk;
			FUZZ_REQUIRE(ddbitem_key(it, &conv, &sk) == 0,
			             "an unprocessed item without a key");
		}
	} else {
		FUZZ_REQUIRE(!unprocessed, "an error with a result");
	}
	json_decref(unprocessed);

	rc = ddbitem_query_parse(body, size, &items, &last_key, &err);
	FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_BAD_REQUEST, "query_parse: %s", error_code_str(rc));
	if (rc == ERR_OK) {
		FUZZ_REQUIRE(json_is_array(items), "items is not an array");
		FUZZ_REQUIRE(!last_key || json_is_object(last_key), "last key is not an object");
		restore_items(items);
	} else {
		FUZZ_REQUIRE(!items && !last_key, "an error with a result");
	}
	json_decref(items);
	json_decref(last_key);

	if (ddbitem_error_parse(body, size, type, sizeof(type), message, sizeof(message)) == 0) {
		FUZZ_REQUIRE(memchr(type, '\0', sizeof(type)) &&
		                 memchr(message, '\0', sizeof(message)),
		             "an error name or message not terminated");
		(void)ddbitem_error_permanent(type);
	}

	/* The body as one item (what a GetItem would hold), and each AttributeValue of it
	 * through the value codec both ways. */
	root = json_loadb(body, size, JSON_ALLOW_NUL, &jerr);
	if (json_is_object(root)) {
		const char *key;
		json_t *av;
		check_item(root);
		json_object_foreach(root, key, av)
		{
			json_t *j = NULL, *av2 = NULL, *j2 = NULL;
			if (ddbitem_attr_to_json(av, &j, &err) == ERR_OK) {
				rc = ddbitem_attr_from_json(j, &av2, &err);
				FUZZ_REQUIRE(rc == ERR_OK || rc == ERR_BAD_REQUEST,
				             "attr_from_json: %s", error_code_str(rc));
				if (rc == ERR_OK) {
					rc = ddbitem_attr_to_json(av2, &j2, &err);
					FUZZ_REQUIRE(rc == ERR_OK,
					             "an AttributeValue the codec wrote cannot be "
					             "read: %s",
					             err.message);
					FUZZ_REQUIRE(json_equal(j, j2),
					             "a value changed in a round trip");
				}
			}
			json_decref(j);
			json_decref(av2);
			json_decref(j2);
		}
	}
	json_decref(root);
	return 0;
}
