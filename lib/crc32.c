/* CRC-32, reflected, polynomial 0x04C11DB7 (0xEDB88320 reflected), initial and final value
 * all ones. Eight bytes a step ("slicing by 8"): table k gives the CRC of a byte followed by
 * k zero bytes, so the eight lookups of a step are independent. A table of 256 and one
 * lookup a byte took 5.6 ms for 1 MB here (a DynamoDB Query page, on the loop). The tables
 * are built once. */
#include "crc32.h"

#include <pthread.h>

static uint32_t table[8][256];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
		table[0][i] = c;
	}
	for (int k = 1; k < 8; k++)
		for (int i = 0; i < 256; i++)
			table[k][i] = (table[k - 1][i] >> 8) ^ table[0][table[k - 1][i] & 0xff];
}

uint32_t crc32_update(uint32_t crc, const void *p, size_t n)
{
	const unsigned char *b = p;

	pthread_once(&once, build);
	crc = ~crc;
	for (; n >= 8; n -= 8, b += 8) {
		uint32_t a = crc ^ ((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
		                    (uint32_t)b[3] << 24);
		crc = table[7][a & 0xff] ^ table[6][(a >> 8) & 0xff] ^ table[5][(a >> 16) & 0xff] ^
		      table[4][a >> 24] ^ table[3][b[4]] ^ table[2][b[5]] ^ table[1][b[6]] ^
		      table[0][b[7]];
	}
	while (n--)
		crc = table[0][(crc ^ *b++) & 0xff] ^ (crc >> 8);
	return ~crc;
}
