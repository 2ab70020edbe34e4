"""The files security settings live in: read with a message naming the file, and a signature that
changes when a file is replaced, by which a server notices renewed certificates and tokens."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvindex.security.errors import SecurityConfigError

# Re-reading files is a stat() per check; once a second bounds it under any call or handshake rate.
RELOAD_CHECK_INTERVAL = 1.0


def read_file(path: str | Path, what: str) -> bytes:
    """The file's bytes; SecurityConfigError naming ``what`` and the file when it cannot be read or is
    empty."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecurityConfigError(f"{what} {path} is empty")
    return data


def file_signature(paths: Iterable[str | Path | None]) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is replaced (also through a Kubernetes Secret's symlink swap)."""
    out = []
    for p in paths:
        if p is None:
            continue
        try:
            st = os.stat(p)
        except OSError:
            out.append((-1, -1, -1))
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)
