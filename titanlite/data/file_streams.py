"""Reading a local data file's bytes: decompressing streams, forward reads, parquet text columns.

Files are streamed, never read whole: `open_stream` decompresses gzip or Zstandard incrementally, and a
`ForwardReader` serves byte ranges of a compressed file in increasing order by decompressing forward,
so reading a shard's documents decompresses each file once. A truncated `.zst` file raises EOFError as
a truncated gzip file does (`ZstdFrames`), and `read_errors` lists what a damaged file raises, so the
scan reports the file instead of failing. zstandard and pyarrow are optional: a file that needs one
says which package to install.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import BinaryIO

from titanlite.data.local_files import Compression
from titanlite.errors import DataError

_SKIP_CHUNK = 64 << 10  # decompress-and-discard step of a forward seek


def require_zstandard() -> None:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        raise DataError("reading .zst files needs the zstandard package: pip install 'titanlite[data]'") from None


def require_pyarrow() -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading .parquet files needs pyarrow: pip install pyarrow") from None


def read_parquet_column(path: Path, field: str) -> list[str | None]:
    """The text column, with None for rows that have no usable text."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if field not in table.column_names:
        raise ValueError(f"no column {field!r} (columns: {', '.join(table.column_names)})")
    return [t if isinstance(t, str) and t.strip() else None for t in table.column(field).to_pylist()]


def open_stream(path: Path, compression: Compression) -> BinaryIO:
    """The file's (decompressed) bytes as a buffered binary stream, read incrementally."""
    if compression == "gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zst":
        return io.BufferedReader(ZstdFrames(path))  # type: ignore[return-value]
    return open(path, "rb")


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file, frame after frame (parallel compressors write several).

    zstandard's own stream reader returns a truncated file's bytes as if it were whole; here a file that
    ends inside a frame raises EOFError, as a truncated gzip file does, so the file is reported.
    """

    def __init__(self, path: Path) -> None:
        import zstandard

        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)  # also files made with --long
        self._file = open(path, "rb")
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # the current frame has had input
        self._out = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._out:
            data = self._file.read(_SKIP_CHUNK)
            if not data:
                if self._in_frame and not self._frame.eof:
                    raise EOFError("the file ends inside a Zstandard frame (truncated)")
                return 0
            self._out = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame.eof:
                self._frame = self._dctx.decompressobj()
            self._in_frame = True
            out.append(self._frame.decompress(data))
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged file raises: I/O, truncated or corrupt gzip/parquet, corrupt zstd."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


class ForwardReader:
    """Reads byte ranges of a (compressed) stream in increasing order by decompressing forward; an
    earlier offset (the next pass) reopens the file."""

    def __init__(self, path: Path, compression: Compression) -> None:
        self.path, self.compression = path, compression
        self._f: BinaryIO | None = None
        self._pos = 0

    def read(self, offset: int, length: int) -> bytes:
        if self._f is None or offset < self._pos:
            self.close()
            self._f, self._pos = open_stream(self.path, self.compression), 0
        while self._pos < offset:
            chunk = self._f.read(min(offset - self._pos, _SKIP_CHUNK))
            if not chunk:
                raise EOFError(f"{self.path} ended before byte {offset}")
            self._pos += len(chunk)
        data = self._f.read(length)
        self._pos += len(data)
        return data

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
