/* Fuzz target for what the local store reads back from its file: a row of message records
 * (lib/msgrec.h, a batch or a segment) whose maps are packed (message_pack) or JSON text
 * (schema 1 to 3). The file may be damaged, so every byte string must read as records or
 * stop with an error, never past its end. Every record read must write back to the same
 * bytes; every map that decodes (as daemon/store.c's record_decode does) must survive a
 * round trip through message_pack and message_unpack with the same message map. */
#include <errno.h>
#include <stdbool.h>
#include <string.h>

#include "buf.h"
#include "fuzz.h"
#include "message.h"
#include "msgrec.h"
#include "ulid.h"

/* A message decoded from a record: packed again, it must unpack to the same map. */
static void check_message(const struct message *m, const char *id, uint32_t version)
{
	struct buf b = {NULL, 0, 0};
	struct message *m2 = NULL;
	struct error err = {ERR_OK, ""};
	json_t *map = message_to_map(m), *map2;
	enum error_code rc;

	FUZZ_REQUIRE(map, "message_to_map failed on a decoded message");
	FUZZ_REQUIRE(message_pack(&b, m) == 0, "message_pack failed");
	rc = message_unpack(b.data, b.len, id, version, &m2, &err);
	FUZZ_REQUIRE(rc == ERR_OK, "a packed message does not unpack: %s", err.message);
	map2 = message_to_map(m2);
	FUZZ_REQUIRE(map2 && json_equal(map, map2), "the map changed in a pack round trip");
	FUZZ_REQUIRE(m2->version == version, "the version changed in a pack round trip");
	json_decref(map);
	json_decref(map2);
	message_free(m2);
	buf_free(&b);
}

/* memcmp, which may not be given NULL even for no bytes. */
static bool same(const char *a, const char *b, size_t n)
{
	return n == 0 || memcmp(a, b, n) == 0;
}

static void check_record(const struct msgrec *r)
{
	struct buf b = {NULL, 0, 0};
	struct msgrec r2;
	struct message *m = NULL;
	struct error err = {ERR_OK, ""};
	size_t pos = 0;
	const char *id;

	/* The record writes back to bytes that read as the same record. */
	FUZZ_REQUIRE(msgrec_append(&b, r) == 0, "a record read cannot be written back");
	FUZZ_REQUIRE(msgrec_next(b.data, b.len, &pos, &r2) == 1 && pos == b.len,
	             "a record written does not read back whole");
	FUZZ_REQUIRE(r2.conv_len == r->conv_len && r2.sk_len == r->sk_len &&
	                 r2.map_len == r->map_len && r2.version == r->version &&
	                 r2.client_seen == r->client_seen && r2.updated_ms == r->updated_ms &&
	                 r2.packed == r->packed,
	             "a record's fields changed in a round trip");
	FUZZ_REQUIRE(same(r2.conv, r->conv, r->conv_len) && same(r2.sk, r->sk, r->sk_len) &&
	                 same(r2.map, r->map, r->map_len),
	             "a record's bytes changed in a round trip");
	buf_free(&b);

	/* Its map, as the store decodes it. */
	if (r->version < 1)
		return;
	if (r->packed) {
		id = r->sk_len < ULID_LEN ? NULL : r->sk + r->sk_len - ULID_LEN;
		if (!id || !ulid_valid(id, ULID_LEN))
			return;
		if (message_unpack(r->map, r->map_len, id, r->version, &m, &err) != ERR_OK) {
			FUZZ_REQUIRE(err.code != ERR_OK && err.message[0], "a refusal without a reason");
			return;
		}
		check_message(m, id, r->version);
	} else {
		json_error_t je;
		json_t *map = json_loadb(r->map, r->map_len, JSON_ALLOW_NUL, &je);
		if (!map)
			return;
		if (message_from_map(map, r->version, &m, &err) == ERR_OK)
			check_message(m, m->id, r->version);
		json_decref(map);
	}
	message_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *p = (const char *)data;
	size_t pos = 0;
	struct msgrec r;
	int rc;

	/* At most as many records as bytes: each takes at least one. */
	for (size_t n = 0; n <= size; n++) {
		size_t before = pos;
		rc = msgrec_next(p, size, &pos, &r);
		if (rc != 1) {
			FUZZ_REQUIRE(rc == 0 || rc == -EINVAL, "msgrec_next: %d", rc);
			FUZZ_REQUIRE(pos == before, "a refused record moved the position");
			FUZZ_REQUIRE(rc == -EINVAL || pos == size, "the end before the end");
			return 0;
		}
		FUZZ_REQUIRE(pos > before && pos <= size, "a record outside its row");
		FUZZ_REQUIRE(r.sk >= p && r.sk + r.sk_len <= p + pos && r.map >= p &&
		                 r.map + r.map_len <= p + pos,
		             "a record's fields outside its bytes");
		check_record(&r);
	}
	FUZZ_REQUIRE(0, "more records than bytes");
	return 0;
}
