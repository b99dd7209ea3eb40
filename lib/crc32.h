/* CRC-32 (ISO-HDLC: the one of zlib, gzip and Ethernet), for DynamoDB's x-amz-crc32
 * answer header, which carries that checksum of the answer's body. */
#ifndef CONVO_CRC32_H
#define CONVO_CRC32_H

#include <stddef.h>
#include <stdint.h>

/* The checksum of n bytes at p continued from crc (0 to start): crc32(crc32(0, a), b) is
 * the checksum of a followed by b. */
uint32_t crc32_update(uint32_t crc, const void *p, size_t n);

#endif
