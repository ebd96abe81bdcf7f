"""The C allocator of lstmgrad's own processes (the command line and its local worker processes).

glibc gives the top of its heap back to the kernel as soon as a little of it is free (128 KiB by
default), and takes it again with fresh pages, each a page fault and zeroed by the kernel, at the next
allocation.  A batch of small files allocates and frees the same few hundred KiB per file, so it paid
that for every file: 300 files of 20,16,64,64 on numpy's OpenBLAS took 108k page faults and 1.05 s of
system time in 3.7-3.9 s; keeping 16 MiB of free heap at the top (``M_TOP_PAD``) leaves 7.5k faults and
~0.55 s (MKL's runtime already leaves the heap alone: 8.9k faults either way).  Setting it turns off
glibc's sliding mmap threshold, which would leave every block from 128 KiB up mapped and unmapped per
allocation (2000 arrays of 1 MiB: 514k faults instead of 500), so the threshold is set to the 32 MiB
that glibc slides up to by itself (243 faults).  At most 16 MiB more stays resident.  The library never
calls this: a Python program's allocator is its own business.
"""

from __future__ import annotations

import ctypes

M_TOP_PAD = -2  # glibc's mallopt parameters: free bytes kept at the top of the heap when it grows or shrinks,
M_MMAP_THRESHOLD = -3  # and the size from which a block gets its own mapping
TOP_PAD_BYTES = 16 * 2**20
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's own upper bound for the threshold it slides (64-bit)


def keep_heap_top() -> bool:
    """Ask glibc to keep ``TOP_PAD_BYTES`` free at the top of the heap and to map only blocks of
    ``MMAP_THRESHOLD_BYTES`` and more; False where there is no ``mallopt`` (macOS, Windows) or it refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TOP_PAD, TOP_PAD_BYTES))
