"""File checksums for training checkpoints and exports: computed while a file is written, verified when read.

A checksum is a string ``"<algorithm>:<hex>"``.  Written files use XXH3-64 (the ``xxhash`` package, ~8 GB/s
per core, far above a disk's write speed: ``examples/benchmarks/checkpoint_checksum.py`` measures both);
``zlib.crc32`` (stdlib, ~1-2 GB/s) is the fallback where ``xxhash`` is not installed.  Verification reads the
algorithm from the string, so a file recorded with either is checked with the same one.

``HashingStream`` wraps a binary file opened for writing and hashes every byte passed to ``write``, so the
checksum costs no second read of the file.  A large write is hashed on a helper thread while the file's own
write runs (both release the GIL), so it costs about the longer of the two rather than their sum.
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

try:
    import xxhash
except ImportError:  # declared dependency; the stdlib CRC keeps checkpoints checked without it
    xxhash = None

CHUNK_BYTES = 8 << 20  # read size when verifying a file
PARALLEL_BYTES = 1 << 20  # writes at least this large are hashed on a helper thread while they are written
_POOL, _POOL_PID, _POOL_LOCK = None, None, threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():  # a forked child has none of its parent's threads
            _POOL, _POOL_PID = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checksum"), os.getpid()
        return _POOL
ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algorithm: str = ALGORITHM):
    """An incremental hasher with ``update(bytes)`` and ``hexdigest()``."""
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise RuntimeError("this checksum is XXH3-64, which needs the xxhash package: pip install xxhash")
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: xxh3_64, crc32)")


def checksum_of_bytes(data, algorithm: str = ALGORITHM) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return f"{algorithm}:{hasher.hexdigest()}"


def checksum_of_file(path, algorithm: str = ALGORITHM) -> str:
    """Read ``path`` once in ``CHUNK_BYTES`` pieces -> its checksum string."""
    hasher = new_hasher(algorithm)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
    return f"{algorithm}:{hasher.hexdigest()}"


def file_matches(path, recorded: str) -> tuple[bool, str]:
    """(whether ``path`` has the ``recorded`` checksum, the checksum it has now) — read with the recorded algorithm."""
    algorithm = recorded.split(":", 1)[0]
    actual = checksum_of_file(path, algorithm)
    return actual == recorded, actual


class HashingStream:
    """A binary file opened for writing whose ``write`` also feeds a hasher (``checksum()`` when done).

    Everything else (``tell``, ``fileno``, ``flush``, ``close``, ...) is the file's own."""

    def __init__(self, raw, algorithm: str = ALGORITHM):
        self.raw, self.algorithm = raw, algorithm
        self.hasher = new_hasher(algorithm)
        self.nbytes = 0
        self.error = None  # the OSError a write raised (a caller may turn it into another error; this keeps it)
        # a buffered file writes all it is given (or raises): only then may the hash run ahead of the write
        self.whole_writes = isinstance(raw, io.BufferedIOBase)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        hashing = None
        if self.whole_writes and len(view) >= PARALLEL_BYTES:
            hashing = _pool().submit(self.hasher.update, view)  # the caller's buffer lives until we return
        try:
            written = self.raw.write(view)
        except OSError as err:
            self.error = err
            raise
        finally:
            if hashing is not None:
                hashing.result()
        written = len(view) if written is None else written
        if hashing is None:
            self.hasher.update(view[:written])
        self.nbytes += written
        return written

    def checksum(self) -> str:
        return f"{self.algorithm}:{self.hasher.hexdigest()}"

    def writable(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.raw.close()
        return False


def check_enabled(env: str, default: bool = True) -> bool:
    """An on/off environment switch ("1" / "0", unset = ``default``); any other value is an error naming it."""
    value = os.environ.get(env)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{env}={value!r}: use 1 (verify checksums) or 0 (skip)")
    return value == "1"

