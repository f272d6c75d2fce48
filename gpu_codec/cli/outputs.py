"""Where the command line writes: outputs that never destroy anything.

Every output is resolved before any work is done (:func:`resolve_output`) and written at the end
(:func:`write_output`):

- ``-`` is stdout (refused when stdout is a terminal, unless forced: binary data would garble it);
- a path that does not exist becomes a new regular file, written to a temporary file beside it and linked into
  place only once complete, so that nothing half-written is ever seen and a file that appears meanwhile is not
  replaced;
- an existing regular file is refused unless ``force``; with ``force`` it is replaced atomically (temporary file,
  then :func:`os.replace`), keeping its mode bits (a read-only file stays read-only) and, where permitted, its
  owner;
- a symbolic link is never replaced by a regular file: the file it points to is what exists, refused without
  ``force`` and replaced in place of the target with it; a link to nothing is refused;
- a character device (``/dev/null``, ``/dev/full``) or a FIFO is opened and written through, never replaced (a
  FIFO waits for its reader); a block device, a socket or a directory is refused;
- an output that is the same file as an input (same device and inode, whatever the names: a hard link, a
  symlink, ``./x``) is refused, with ``force`` too.

Outputs that cannot seek (stdout, devices, FIFOs) get the whole file from memory, so every format can be written
to them.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> path = os.path.join(d, "out.bin")
>>> write_output(resolve_output(path), lambda f: f.write(b"one"))
>>> resolve_output(path)
Traceback (most recent call last):
...
gpu_codec.errors.InvalidInputError: output .../out.bin exists; pass --force to replace it
>>> os.chmod(path, 0o444)
>>> write_output(resolve_output(path, force=True), lambda f: f.write(b"two"))
>>> with open(path, "rb") as f:
...     f.read(), oct(os.stat(path).st_mode & 0o777)
(b'two', '0o444')
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError


def describe(text: str) -> str:
    """``text`` (a name or a message) made safe for a terminal: non-printable characters escaped, one line.

    >>> describe("a\\x1b[2Jb\\nc")
    'a\\\\x1b[2Jb\\\\nc'
    >>> describe("layer.0.weight")
    'layer.0.weight'
    """
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))


STDOUT = "-"
_TMP_PREFIX = ".gpu-codec-"


@dataclass(frozen=True)
class Target:
    """A resolved output: ``kind`` is ``"stdout"``, ``"new"`` (create ``real``), ``"replace"`` (replace the
    regular file ``real``, keeping ``mode`` and ``owner``) or ``"through"`` (open ``path`` and write: a
    character device or a FIFO)."""

    path: str
    kind: str
    real: str = ""
    mode: int | None = None
    owner: tuple[int, int] | None = None


def _refuse(message: str) -> InvalidInputError:
    return InvalidInputError(message)


def resolve_output(
    path: str, *, inputs: Sequence[str | None] = (), force: bool = False, option: str = "--force"
) -> Target:
    """Check an output path before any work and say how it will be written.

    Parameters
    ----------
    path
        The path given (``-``: stdout).
    inputs
        The command's input files: an output that is the same file as one of them is refused.
    force
        Replace an existing regular file (atomically, keeping its mode); write binary data to a terminal.
    option
        The option that sets ``force``, named in the refusal.

    Raises
    ------
    InvalidInputError
        One line naming the path and the reason: empty, stdout closed or a terminal, a missing folder, a
        directory, a block device or socket, a dangling symbolic link, the same file as an input (stdout too), or
        an existing file without ``force``.
    """
    path = str(path)
    if not path:
        raise _refuse("the output path is empty")
    if path == STDOUT:
        if sys.stdout is None:
            raise _refuse("stdout is closed; redirect it to a file or name an output")
        if not force and _isatty(sys.stdout):
            raise _refuse(f"refusing to write binary data to a terminal; redirect stdout or pass {option}")
        same = _same_as_input(_fstat_stdout(), inputs)
        if same is not None:  # (``-o - >> input``: appended to, or written over, the input being read)
            raise _refuse(f"stdout is the same file as the input {describe(same)}; redirect it to another file")
        return Target(path, "stdout")
    name = describe(path)
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        lst = None
    except OSError as e:  # ENOTDIR, EACCES, ENAMETOOLONG...
        raise _refuse(f"output {name}: {e.strerror or e}") from None
    if lst is None:
        if path.endswith(("/", os.sep)):  # ("out/": a folder's name, which abspath would cut to "out")
            raise _refuse(f"output {name} names a folder; name a file")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise _refuse(f"output folder {describe(folder)} does not exist")
        return Target(path, "new", path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _refuse(f"output {name} is a symbolic link to a missing file; name a file") from None
    except OSError as e:  # a loop of links
        raise _refuse(f"output {name}: {e.strerror or e}") from None
    same = _same_as_input(st, inputs)
    if same is not None:
        raise _refuse(f"output {name} is the same file as the input {describe(same)}; name another file")
    if stat.S_ISDIR(st.st_mode):
        raise _refuse(f"output {name} is a directory; name a file")
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return Target(path, "through", path)
    if not stat.S_ISREG(st.st_mode):
        kind = "a block device" if stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise _refuse(f"output {name} is {kind}; refusing to write to it")
    if not force:
        link = " (a symbolic link to an existing file)" if stat.S_ISLNK(lst.st_mode) else ""
        ro = " (read-only)" if not st.st_mode & 0o222 else ""
        raise _refuse(f"output {name} exists{link}{ro}; pass {option} to replace it")
    real = os.path.realpath(path) if stat.S_ISLNK(lst.st_mode) else path
    return Target(path, "replace", real, stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid))


def _fstat_stdout() -> os.stat_result | None:
    """stdout's file status, where it is a regular file (None otherwise, or where it cannot be read)."""
    try:
        st = os.fstat(sys.stdout.fileno())
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _same_as_input(st: os.stat_result | None, inputs: Sequence[str | None]) -> str | None:
    """The first of ``inputs`` that is the file ``st`` describes (same device and inode), or None."""
    if st is None:
        return None
    for inp in inputs:
        if not inp or inp == STDOUT:
            continue
        try:
            ist = os.stat(inp)
        except OSError:
            continue
        if (ist.st_dev, ist.st_ino) == (st.st_dev, st.st_ino):
            return inp
    return None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def write_output(target: Target, write: Callable[[Any], Any]) -> None:
    """Call ``write(binary_file)`` and put the result where ``target`` says (see the module docstring).

    Nothing is left behind when ``write`` raises: no temporary file, and the existing file (if any) unchanged.
    A write error (``/dev/full``: no space left on device) is an :class:`OSError` naming the path.
    """
    if target.kind in ("stdout", "through"):
        buf = io.BytesIO()  # stdout, devices and FIFOs cannot seek; the formats may need to
        write(buf)
        data = buf.getbuffer()
        if target.kind == "stdout":  # (every byte, or an error: a buffered write may stop short at a closed pipe)
            sys.stdout.flush()
            sys.stdout.buffer.flush()
            _write_all(sys.stdout.fileno(), data, "stdout")
        else:
            _write_through(target.path, data)
        return
    folder = os.path.dirname(os.path.abspath(target.real))
    # (Ctrl-C or kill between the file's making and the try would leave it, and between the descriptor's wrapping
    # and the with block would leave the wrapper unclosed: both are made while the signals are held)
    tmp, f, held = None, None, _hold_signals()
    try:
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".tmp", dir=folder)
        f = os.fdopen(fd, "wb")
        _release_signals(held)  # (one that came meanwhile is raised here, inside the try)
        held = None
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if target.kind == "replace":
            if target.owner is not None:
                with contextlib.suppress(OSError):  # only root may give a file away; keep ours otherwise
                    os.chown(tmp, *target.owner)
            os.chmod(tmp, target.mode if target.mode is not None else 0o644)
            os.replace(tmp, target.real)
        else:
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # the mode open() would give, not mkstemp's 0600
            _link_new(tmp, target.real)
    except OSError as e:  # the output's own errors named by the path given, not the hidden temporary file's
        ours = e.filename is None or e.filename in (folder, target.real)
        if not ours and not os.path.basename(str(e.filename)).startswith(_TMP_PREFIX):
            raise
        raise OSError(e.errno, e.strerror, target.path) from None
    finally:
        _release_signals(held)
        if f is not None:
            f.close()  # (closed already, but where a signal came before the with block)
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


_HELD = (signal.SIGINT, signal.SIGTERM)


def _hold_signals() -> Any:
    """Ctrl-C and kill held back (where the system can, in the main thread): the signal mask before, or None."""
    if not hasattr(signal, "pthread_sigmask") or sys.platform == "win32":
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)


def _release_signals(before: Any) -> None:
    """Put back the signal mask :func:`_hold_signals` changed (None: nothing to put back)."""
    if before is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _link_new(tmp: str, path: str) -> None:
    """Put the complete ``tmp`` at ``path`` unless something appeared there meanwhile (a hard link fails on an
    existing name; where the file system has no hard links, check and rename)."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise _refuse(f"output {describe(path)} appeared while writing; it was left as it is") from None
    except OSError:
        pass  # no hard links here (EPERM, ENOTSUP, EXDEV...)
    if os.path.lexists(path):
        raise _refuse(f"output {describe(path)} appeared while writing; it was left as it is")
    os.rename(tmp, path)


def _write_through(path: str, data: Any) -> None:
    """Write ``data`` into a character device or a FIFO: opened without O_CREAT or O_TRUNC, checked again once
    open (a regular file put there meanwhile is not written)."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
            raise _refuse(f"output {describe(path)} changed while writing; nothing was written")
        _write_all(fd, data, path)
    finally:
        os.close(fd)


def _write_all(fd: int, data: Any, path: str) -> None:
    """Every byte of ``data`` into ``fd``, however few each write takes; an OSError naming ``path`` otherwise."""
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        try:
            done += os.write(fd, view[done:])
        except InterruptedError:
            continue
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None


def stdout_is_output(*paths: str | None) -> bool:
    """Whether one of the outputs is stdout (reports then go to stderr)."""
    return any(p == STDOUT for p in paths)
