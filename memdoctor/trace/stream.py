"""Streaming a trace file's lines: concatenated gzip members, read in linear time and bounded memory.

A trace is one gzip member per record (``TraceWriter``). A file handed to ``memdoctor report`` may be
anything, so this reader never trusts its size: it checks the gzip magic bytes before reading on,
decompresses through a bounded output buffer, counts every decompressed byte against a cap, and
refuses a line longer than a record may be as soon as the line grows past it, never after buffering
the whole file (a 1 MB trace can hold 1 GiB of newlines; a 3 GB file may be no trace at all).

Members are read through a growing input window (doubling to 1 MiB) that starts small for each member
(512 B more than the member before took, which holds most records whole): what zlib hands back after
a member ends (``unused_data``, a copy) is at most one window, so a file of 100,000 tiny members costs
what one large member does, not 100,000 copies of the file's tail. The file is read in blocks of
``_READ`` bytes, and the windows are views into the block (no copy); only the first two bytes are read
before the magic bytes are checked.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import BinaryIO

from memdoctor.errors import TraceError

GZIP_MAGIC = b"\x1f\x8b"
FIRST_WINDOW = 512
_MAX_WINDOW = 1 << 20
_OUT_CHUNK = 1 << 20
_READ = 1 << 20


class GzipLines:
    """The lines (without their newline) of the concatenated gzip members read from ``fh``.

    ``truncated`` is set once iteration ends early at a cut or corrupt member, or at a last line
    without its newline (neither line is yielded). A file that does not start with the gzip magic
    bytes, decompresses to more than ``max_bytes``, or holds a line longer than ``max_line`` is a
    ``TraceError`` naming the cap, raised before more than about one output chunk past it is read.
    """

    def __init__(self, fh: BinaryIO, name: str, *, max_bytes: int, max_line: int) -> None:
        self._fh = fh
        self._name = name
        self.max_bytes = max_bytes
        self.max_line = max_line
        self.truncated = False
        self.decompressed = 0
        self.lines = 0  # lines yielded so far
        self._block = memoryview(b"")  # the input read last, and where in it the next member starts
        self._pos = 0

    def __iter__(self) -> Iterator[bytes]:
        head = self._fh.read(len(GZIP_MAGIC))
        if head != GZIP_MAGIC:
            what = "a memdoctor trace is gzip-compressed JSON Lines"
            raise TraceError(f"{self._name}: not a gzip file; {what}")
        self._block, self._pos = memoryview(head), 0
        carry = bytearray()
        for chunk in self._chunks():
            start = 0
            while (nl := chunk.find(b"\n", start)) >= 0:
                if carry:
                    carry += chunk[start:nl]
                    line = bytes(carry)
                    carry.clear()
                else:
                    line = chunk[start:nl]
                self._check_line(len(line))
                self.lines += 1
                yield line
                start = nl + 1
            carry += chunk[start:]
            self._check_line(len(carry))
        if carry:  # the last record has no newline: it is incomplete
            self.truncated = True

    def _check_line(self, n: int) -> None:
        if n > self.max_line:
            raise TraceError(
                f"{self._name}: record {self.lines + 1} is larger than the cap of {self.max_line} bytes; "
                "refusing the trace"
            )

    def _chunks(self) -> Iterator[bytes]:
        """Decompressed output, member after member, in chunks of at most ``_OUT_CHUNK`` bytes. One flat
        loop (no generator per member): a trace is 100,000 members, each a record of a few hundred bytes."""
        first = FIRST_WINDOW
        while True:
            d = zlib.decompressobj(wbits=31)
            window, used = first, 0
            while not d.eof:
                data: bytes | memoryview = self._take(window)
                if not data:
                    if used:  # the file ends inside a member
                        self.truncated = True
                    return
                used += len(data)
                window = min(window * 2, _MAX_WINDOW)
                while True:
                    try:
                        out = d.decompress(data, _OUT_CHUNK)
                    except zlib.error:
                        self.truncated = True
                        return
                    self.decompressed += len(out)
                    if self.decompressed > self.max_bytes:
                        raise TraceError(
                            f"{self._name}: the trace decompresses to more than the cap of {self.max_bytes} "
                            "bytes; refusing to load it"
                        )
                    if out:
                        yield out
                    data = d.unconsumed_tail
                    if d.eof or (not data and len(out) < _OUT_CHUNK):
                        break
            unused = d.unused_data
            self._pos -= len(unused)  # hand back what the member did not use: the next one starts there
            first = min(used - len(unused) + FIRST_WINDOW, _MAX_WINDOW)

    def _take(self, n: int) -> memoryview:
        """Up to ``n`` bytes of input, a view into the block read last (the next block once it is used)."""
        if self._pos >= len(self._block):
            self._block, self._pos = memoryview(self._fh.read(max(n, _READ))), 0
        piece = self._block[self._pos : self._pos + n]
        self._pos += len(piece)
        return piece
