/* Unit tests for lib/error: wire names and precedence order. */
#include "error.h"
#include "test.h"

int main(void)
{
	struct error e;
	CHECK_STR(error_code_str(ERR_PARSE_ERROR), "parse_error");
	CHECK_STR(error_code_str(ERR_TOO_LARGE), "too_large");
	CHECK_STR(error_code_str(ERR_UNKNOWN_OP), "unknown_op");
	CHECK_STR(error_code_str(ERR_BAD_REQUEST), "bad_request");
	CHECK_STR(error_code_str(ERR_NOT_FOUND), "not_found");
	CHECK_STR(error_code_str(ERR_CONFLICT), "conflict");
	CHECK_STR(error_code_str(ERR_UNAVAILABLE), "unavailable");
	CHECK_STR(error_code_str(ERR_INTERNAL), "internal");
	CHECK(ERR_PARSE_ERROR < ERR_TOO_LARGE && ERR_TOO_LARGE < ERR_UNKNOWN_OP &&
	      ERR_UNKNOWN_OP < ERR_BAD_REQUEST && ERR_BAD_REQUEST < ERR_NOT_FOUND &&
	      ERR_NOT_FOUND < ERR_CONFLICT && ERR_CONFLICT < ERR_UNAVAILABLE &&
	      ERR_UNAVAILABLE < ERR_INTERNAL);
	CHECK(error_set(&e, ERR_BAD_REQUEST, "contents: expected %s", "a string") ==
	      ERR_BAD_REQUEST);
	CHECK(e.code == ERR_BAD_REQUEST);
	CHECK_STR(e.message, "contents: expected a string");
	CHECK(error_set(NULL, ERR_CONFLICT, "x") == ERR_CONFLICT);
	return test_done("error");
}
