"""Joining CRC-32s of consecutive pieces: ``combine(crc(a), crc(b), len(b)) == crc(a + b)``.

A zip member's CRC-32 covers its bytes in order, while a backward pass reads a member left in its file last steps
first: each piece's CRC is summed as it is read, and the pieces' are joined in file order at the end.  This is
zlib's ``crc32_combine`` (not in Python's zlib module): appending ``n`` zero bytes multiplies a CRC by ``x^(8n)``
modulo the CRC-32 polynomial, done here by squaring (about 2 * 32 steps per bit of ``n``, some 0.1 ms a join).
"""

from __future__ import annotations

import functools

POLY = 0xEDB88320  # CRC-32's polynomial, bits reversed (as zlib keeps it)


def _times(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (both bit-reversed: the top bit is x^0)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return product


def _x_to_2_to_the(k: int) -> int:
    """``x^(2^k)`` modulo the polynomial."""
    p = 1 << 30  # x^1
    for _ in range(k):
        p = _times(p, p)
    return p


@functools.cache
def _powers() -> tuple[int, ...]:
    """x^(2^k) for k < 32, made on first use (1.6 ms: not at every start).  They repeat from there (x^(2^32) is x
    again modulo CRC-32's polynomial, as zlib relies on and a test checks), so a length's bits past the 29th take
    the table's entries again."""
    return tuple(_x_to_2_to_the(k) for k in range(32))


def _x_to_8_times(n: int) -> int:
    """``x^(8 n)`` modulo the polynomial."""
    powers = _powers()
    p, k = 1 << 31, 3  # x^0; 8 n = n << 3
    while n:
        if n & 1:
            p = _times(powers[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of two pieces one after the other, from each one's CRC-32 and the second one's length in bytes."""
    return _times(_x_to_8_times(second_length), first) ^ second
