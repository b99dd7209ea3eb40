/* Test helper: a store written as an older convod wrote it (see store_legacy.h). */
#include "store_legacy.h"

#include <sqlite3.h>
#include <stdio.h>

#include "buf.h"
#include "message.h"
#include "msgrec.h"
#include "ulid.h"

long unpack_rows(const char *dir, const char *table)
{
	char path[160], q[96];
	sqlite3 *db = NULL;
	sqlite3_stmt *rd = NULL, *wr = NULL;
	struct buf out = {NULL, 0, 0}, map = {NULL, 0, 0};
	long n = 0;

	snprintf(path, sizeof(path), "%s/convod.db", dir);
	if (sqlite3_open(path, &db) != SQLITE_OK)
		goto fail;
	if (sqlite3_exec(db, "SELECT 1 FROM batches1 LIMIT 0", NULL, NULL, NULL) == SQLITE_OK &&
	    sqlite3_exec(db, "INSERT INTO batches SELECT * FROM batches1; DROP TABLE batches1",
	                 NULL, NULL, NULL) != SQLITE_OK)
		goto fail;
	snprintf(q, sizeof(q), "SELECT seq, data FROM %s", table);
	if (sqlite3_prepare_v2(db, q, -1, &rd, NULL) != SQLITE_OK)
		goto fail;
	snprintf(q, sizeof(q), "UPDATE %s SET data = ? WHERE seq = ?", table);
	if (sqlite3_prepare_v2(db, q, -1, &wr, NULL) != SQLITE_OK)
		goto fail;
	while (sqlite3_step(rd) == SQLITE_ROW) {
		const char *data = sqlite3_column_blob(rd, 1);
		size_t len = (size_t)sqlite3_column_bytes(rd, 1), pos = 0;
		struct msgrec r;
		out.len = 0;
		while (msgrec_next(data, len, &pos, &r) == 1) {
			struct message *m = NULL;
			struct error e;
			if (!r.packed ||
			    message_unpack(r.map, r.map_len, r.sk + r.sk_len - ULID_LEN, r.version,
			                   &m, &e) != ERR_OK)
				goto fail;
			map.len = 0;
			int rc = message_write_map(&map, m);
			message_free(m);
			r.map = map.data;
			r.map_len = map.len;
			r.packed = false;
			if (rc < 0 || msgrec_append(&out, &r) < 0)
				goto fail;
			n++;
		}
		if (pos != len)
			goto fail;
		sqlite3_bind_blob(wr, 1, out.data, (int)out.len, SQLITE_STATIC);
		sqlite3_bind_int64(wr, 2, sqlite3_column_int64(rd, 0));
		if (sqlite3_step(wr) != SQLITE_DONE)
			goto fail;
		sqlite3_reset(wr);
	}
	if (sqlite3_exec(db, "PRAGMA user_version=3", NULL, NULL, NULL) != SQLITE_OK)
		goto fail;
	goto done;
fail:
	n = -1;
done:
	sqlite3_finalize(rd);
	sqlite3_finalize(wr);
	sqlite3_close(db);
	buf_free(&out);
	buf_free(&map);
	return n;
}
