"""File checksums for training checkpoints and exports: computed while a file is written, verified when read.

A checksum is a string ``"<algorithm>:<hex>"``.  Written files use XXH3-64 (the ``xxhash`` package, ~8 GB/s
per core, far above a disk's write speed: ``examples/benchmarks/checkpoint_checksum.py`` measures both);
``zlib.crc32`` (stdlib, ~1-2 GB/s) is the fallback where ``xxhash`` is not installed.  Verification reads the
algorithm from the string, so a file recorded with either is checked with the same one.

``HashingStream`` wraps a binary file opened for writing and hashes every byte passed to ``write``, so the
checksum costs no second read of the file.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

try:
    import xxhash
except ImportError:  # declared dependency; the stdlib CRC keeps checkpoints checked without it
    xxhash = None

CHUNK_BYTES = 8 << 20  # read size when verifying a file
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

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
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


def relative_names(folder: Path, paths) -> list[str]:
    return sorted(str(Path(p).relative_to(folder)) for p in paths)
