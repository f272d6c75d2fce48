"""Files written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any


def replace_atomically(path: str | os.PathLike, write: Callable[[Any], None], prefix: str = ".tmp-") -> None:
    """``write(f)`` into a temporary file beside ``path``, then moved into place: a failure (an exception, an
    interruption, a full disk) leaves ``path`` as it was and no temporary file behind. The new file has mode 0600.

    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.bin"
    >>> replace_atomically(p, lambda f: f.write(b"one"))
    >>> try:
    ...     replace_atomically(p, lambda f: 1 / 0)
    ... except ZeroDivisionError:
    ...     pass
    >>> p.read_bytes(), [q.name for q in p.parent.iterdir()]
    (b'one', ['x.bin'])
    """
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = ["replace_atomically"]
