"""Checkpoint files for the command line: torch ``.pt``/``.pth``, ``.safetensors`` and ``.npz``.

A checkpoint is a flat mapping of tensor name -> array (a NumPy array, or a CPU torch tensor where torch read
it). Every file is hostile input: nothing is unpickled (``torch.load(..., weights_only=True)``, ``.npy`` members
read with their header checked before any allocation), and every problem is an
:class:`~gpu_codec.errors.InvalidInputError` with one line that names the file.

Tensor names are data, never paths. An ``.npz`` is written member by member with :mod:`zipfile`: each member
name is the percent-encoded tensor name (no ``/``, no leading dot, nothing a shell or an unzip tool could read
as a path), and the original name travels as JSON in that member's zip comment (:data:`NAME_COMMENT` + JSON
string), where ``np.load`` does not see it: NumPy lists only the arrays. Reading honours those comments and
falls back to NumPy's own naming (member name minus ``.npy``) for archives written by ``np.savez``.

>>> import tempfile, os, numpy as np
>>> d = tempfile.mkdtemp()
>>> path = os.path.join(d, "m.npz")
>>> write_checkpoint(path, {"../evil": np.ones(2, np.float32), "file": np.zeros(1, np.float32)})
'npz'
>>> sorted(read_checkpoint(path).tensors)
['../evil', 'file']
>>> npz_member_name("../evil")
'%2E.%2Fevil.npy'
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import urllib.parse
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import declared_shape_problem
from ..errors import InvalidInputError
from .outputs import Target, describe, resolve_output, write_output

FORMATS = {".pt": "torch", ".pth": "torch", ".safetensors": "safetensors", ".npz": "npz"}
NAME_COMMENT = b"gpu_codec.name:"
_CHUNK = 64 << 20
_MAX_MEMBER_NAME = 240  # longer encoded names get an index-based member name


@dataclass
class Checkpoint:
    """A checkpoint read from a file: its format (``"torch"``, ``"safetensors"`` or ``"npz"``) and its tensors
    in file order (NumPy arrays or CPU torch tensors)."""

    format: str
    tensors: dict[str, Any]


def checkpoint_format(path: str) -> str:
    """The format named by a path's suffix; a :class:`~gpu_codec.errors.InvalidInputError` for any other.

    >>> checkpoint_format("model.safetensors"), checkpoint_format("m.PT")
    ('safetensors', 'torch')
    """
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix in FORMATS:
        return FORMATS[suffix]
    hint = " (a .npy holds a single array; save the state dict as .npz)" if suffix == ".npy" else ""
    raise InvalidInputError(
        f"{describe(path)}: cannot tell the checkpoint format from the suffix {describe(suffix) or '(none)'!s}; "
        f"use one of {', '.join(FORMATS)}{hint}"
    )


def read_checkpoint(path: str) -> Checkpoint:
    """Read a flat state dict from ``path`` (format by suffix).

    Parameters
    ----------
    path
        A ``.pt``/``.pth`` (torch, read with ``weights_only=True``), ``.safetensors`` or ``.npz`` file.

    Returns
    -------
    Checkpoint
        The format and the tensors in file order (safetensors: sorted by name), as NumPy arrays or CPU torch
        tensors; non-float tensors are kept (the caller decides what to do with them).

    Raises
    ------
    InvalidInputError
        The file is missing, unreadable, corrupt, not a flat mapping of name -> tensor, or holds object arrays.
    """
    fmt = checkpoint_format(path)
    check_input(path)
    reader = {"npz": _read_npz, "torch": _read_torch, "safetensors": _read_safetensors}[fmt]
    tensors = reader(path)
    if not tensors:
        raise InvalidInputError(f"{describe(path)} holds no tensors")
    return Checkpoint(fmt, tensors)


def write_checkpoint(dest: Any, tensors: Mapping[str, Any], fmt: str | None = None) -> str:
    """Write ``tensors`` as a checkpoint, never destroying anything (see :mod:`gpu_codec.cli.outputs`).

    Parameters
    ----------
    dest
        A path (a new file; an existing one is refused) or a :class:`~gpu_codec.cli.outputs.Target` that
        :func:`~gpu_codec.cli.outputs.resolve_output` checked before the work began (stdout, a device, a FIFO,
        a file to replace with ``--force``).
    tensors
        Name -> NumPy array or torch tensor. Names are stored as data (see the module docstring for ``.npz``).
    fmt
        ``"npz"``, ``"torch"`` or ``"safetensors"``; default: the format the suffix names.

    Returns
    -------
    str
        The format written.

    Raises
    ------
    InvalidInputError
        The output is refused (see :func:`~gpu_codec.cli.outputs.resolve_output`), or a tensor cannot be stored
        in the format (bfloat16 in ``.npz``, a name ``safetensors`` reserves).
    """
    target = dest if isinstance(dest, Target) else resolve_output(dest)
    fmt = fmt or checkpoint_format(target.path)
    writer_ready(fmt, "stdout" if target.kind == "stdout" else target.path)
    writer: Callable[[Any, Mapping[str, Any]], None] = {
        "npz": _write_npz,
        "torch": _write_torch,
        "safetensors": _write_safetensors,
    }[fmt]
    write_output(target, lambda f: writer(f, tensors))
    return fmt


def writer_ready(fmt: str, name: str) -> None:
    """Refuse, naming the output ``name``, a format whose package is not installed (``torch`` for ``.pt``,
    ``safetensors``): checked before any work, not when the result is written.

    >>> writer_ready("npz", "out.npz")  # (NumPy alone)
    """
    if fmt == "torch":
        _torch(name)
    elif fmt == "safetensors":
        _safetensors(name)


def check_input(path: str) -> None:
    """Refuse an input path that does not exist or is not a regular file (a directory, a device, a pipe)."""
    if not os.path.exists(path):
        raise InvalidInputError(f"{describe(path)}: no such file")
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise InvalidInputError(f"{describe(path)} is {kind}")


def is_float_tensor(a: Any) -> bool:
    """Whether the engine can compress ``a``: fp16, bf16 (torch), fp32 or fp64."""
    if isinstance(a, np.ndarray):
        return a.dtype in (np.float16, np.float32, np.float64)
    return str(getattr(a, "dtype", "")) in ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


def dtype_name(a: Any) -> str:
    """``float32``, ``bfloat16``, ``int64``... for a NumPy array or a torch tensor."""
    return str(a.dtype).removeprefix("torch.")


def as_numpy(name: str, a: Any, what: str) -> np.ndarray:
    """A NumPy array for ``a``; bfloat16 has no NumPy dtype and is refused with a clear error."""
    if isinstance(a, (np.ndarray, np.generic)):
        return np.asarray(a)  # (a NumPy scalar: a 0-d array)
    if dtype_name(a) == "bfloat16":
        raise InvalidInputError(f"tensor {describe(repr(name))} is bfloat16, which {what} cannot store")
    if type(a).__module__.startswith("cupy"):
        return a.get()
    try:
        return a.detach().cpu().numpy()
    except TypeError:  # (a torch dtype with no NumPy form: float8, complex32)
        kind = dtype_name(a)
        raise InvalidInputError(f"tensor {describe(repr(name))} is {kind}, which {what} cannot store") from None


def as_torch(a: Any) -> Any:
    """A CPU torch tensor for ``a`` (NumPy arrays are copied when they are read-only)."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a, order="C")  # (not ascontiguousarray, which makes a 0-d array 1-d)
    if not a.flags.writeable:
        a = a.copy()
    try:
        return torch.from_numpy(a)
    except TypeError:  # (torch before 2.3 has no uint16, uint32, uint64)
        raise InvalidInputError(
            f"torch {torch.__version__} has no {a.dtype} tensor for a .pt file; write .npz or .safetensors"
        ) from None


# --- .npz ------------------------------------------------------------------------------------------------------


def npz_member_name(name: str, index: int = 0) -> str:
    """The zip member holding tensor ``name``: percent-encoded, never a path, at most ~240 characters.

    >>> npz_member_name("conv.weight"), npz_member_name("a/b"), npz_member_name("x" * 300, 7)
    ('conv.weight.npy', 'a%2Fb.npy', '%long-7.npy')
    """
    enc = urllib.parse.quote(name, safe="")
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > _MAX_MEMBER_NAME:
        enc = f"%long-{index}"  # "%l" never comes out of quote(), so this cannot collide with an encoded name
    return enc + ".npy"


def _npz_error(path: str, what: str) -> InvalidInputError:
    return InvalidInputError(f"{describe(path)}: {what}")


def _comment_name(path: str, info: zipfile.ZipInfo) -> str | None:
    if not info.comment.startswith(NAME_COMMENT):
        return None
    try:
        name = json.loads(info.comment[len(NAME_COMMENT) :].decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        name = None
    if not isinstance(name, str):
        raise _npz_error(path, f"member {describe(repr(info.filename))} has a malformed name comment")
    return name


def _read_npz(path: str) -> dict[str, np.ndarray]:
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            members = [i.filename for i in infos]
            if len(set(members)) != len(members):
                raise _npz_error(path, "the archive names a member twice")
            commented = [_comment_name(path, i) for i in infos]
            if any(c is not None for c in commented) and any(c is None for c in commented):
                raise _npz_error(path, "some members carry a tensor name comment and some do not")
            order = []
            for i, c in zip(infos, commented):
                if i.flag_bits & 0x1:
                    raise _npz_error(path, f"member {describe(repr(i.filename))} is encrypted")
                if not i.filename.endswith(".npy"):
                    raise _npz_error(path, f"member {describe(repr(i.filename))} is not an .npy array")
                order.append((i, c if c is not None else i.filename[: -len(".npy")]))  # else np.savez naming
            names = [n for _, n in order]
            if len(set(names)) != len(names):
                raise _npz_error(path, "two members hold the same tensor name")
            return {n: _read_member(path, zf, i, n) for i, n in order}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError) as e:
        raise _npz_error(path, f"not a readable .npz archive ({describe(e)})") from None
    except OSError as e:
        if e.filename is not None:  # (the file itself: named by the error)
            raise
        raise _npz_error(path, f"not a readable .npz archive ({describe(e.strerror or e)})") from None


def check_shape(path: str, name: str, shape: Any) -> None:
    """Refuse, naming the file and the tensor, a shape no array can have
    (:func:`~gpu_codec.arrays.declared_shape_problem`); its sizes are never printed (a size of 4,000 digits).

    >>> check_shape("m.npz", "w", (3, 4))
    >>> check_shape("m.npz", "w", (2**40, 2**40, 0))
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: m.npz: tensor 'w' declares a shape whose sizes multiply past 2^56
    """
    problem = declared_shape_problem(shape)
    if problem is not None:
        raise InvalidInputError(f"{describe(path)}: tensor {describe(repr(name))} {problem}")


def _read_member(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> np.ndarray:
    where = f"tensor {describe(repr(name))}"
    with zf.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version} is not supported")
        except (ValueError, SyntaxError, TypeError) as e:
            raise _npz_error(path, f"{where}: not a valid .npy array ({describe(e)})") from None
        if dtype.hasobject:
            raise _npz_error(path, f"{where}: object arrays are refused (reading them would need pickle)")
        if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biufc":
            raise _npz_error(path, f"{where}: dtype {describe(dtype)} is not a plain numeric dtype")
        check_shape(path, name, shape)
        nbytes = math.prod(shape) * dtype.itemsize
        left = info.file_size - f.tell()
        if nbytes != left:  # checked before allocating anything
            raise _npz_error(path, f"{where}: header says {nbytes} bytes of data, the member holds {left}")
        buf = bytearray()  # grown as data arrives: a size the archive only claims is never allocated up front
        while len(buf) < nbytes:
            chunk = f.read(min(_CHUNK, nbytes - len(buf)))
            if not chunk:
                raise _npz_error(path, f"{where}: data ends after {len(buf)} of {nbytes} bytes")
            buf += chunk
        f.read(1)  # reaching the end makes zipfile check the member's CRC-32
    a = np.frombuffer(buf, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return np.asarray(a, order="C")  # a 0-d member stays 0-d


def _write_npz(f: Any, tensors: Mapping[str, Any]) -> None:
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for i, (name, a) in enumerate(tensors.items()):
            arr = np.asarray(as_numpy(name, a, ".npz"), order="C")
            info = zipfile.ZipInfo(npz_member_name(name, i), date_time=(1980, 1, 1, 0, 0, 0))
            info.comment = NAME_COMMENT + json.dumps(name, ensure_ascii=True).encode()
            if len(info.comment) > 0xFFFF:
                raise InvalidInputError(f"tensor name of {len(name)} characters is too long for an .npz member")
            with zf.open(info, "w", force_zip64=True) as m:
                np.lib.format.write_array(m, arr, allow_pickle=False)


# --- torch -----------------------------------------------------------------------------------------------------


def _torch(path: str) -> Any:
    try:
        import torch
    except ImportError:
        raise InvalidInputError(
            f"{describe(path)}: reading or writing .pt needs torch (pip install torch; on a machine without a GPU, "
            "its CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        ) from None
    return torch


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return describe(f"{type(e).__name__}: {text[0]}" if text else type(e).__name__)


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6; older files are a pickle (protocol byte 0x80)
_GLOBAL = re.compile(r"(?:unsupported GLOBAL|Unsupported class) ([\w.]+)")  # (torch 2.2 on; torch 2.1)
# what torch.save's older format pickles first (a long), whatever the protocol: the file is torch's
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _torch_refusal(path: str, head: bytes, e: BaseException) -> InvalidInputError:
    """Our one line for a file torch's restricted unpickler refused: what was in it, never torch's advice to
    load it unrestricted."""
    text = str(e)
    found = _GLOBAL.search(text)
    if found:
        why = f"it holds Python objects beyond tensors ({describe(found.group(1))}), which are never unpickled"
    elif "Unsupported operand" in text and (head.startswith(_ZIP_MAGIC) or _LEGACY_MAGIC in head):
        # (torch.save's, with another pickle protocol than its default 2, whose opcodes torch's loader reads)
        why = "torch.save wrote it with a pickle protocol whose opcodes torch's restricted loader does not read"
    elif not head.startswith(_ZIP_MAGIC) and (isinstance(e, pickle.UnpicklingError) or _LEGACY_MAGIC not in head):
        why = "it is a pickle that torch.save did not write; pickles are never loaded"
    elif isinstance(e, pickle.UnpicklingError):
        why = "it holds objects beyond tensors, which are never unpickled"
    else:
        lines = [ln for ln in text.strip().splitlines() if ln.strip() and "weights_only" not in ln]
        why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return InvalidInputError(f"{describe(path)}: not a readable torch state dict ({describe(why)})")


def _read_torch(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(32)
    if not head.startswith(_ZIP_MAGIC) and not head.startswith(b"\x80"):
        raise InvalidInputError(
            f"{describe(path)}: not a torch checkpoint (torch.save writes a zip archive; this file is neither "
            "that nor a pickle)"
        )
    torch = _torch(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before it refuses: ours is the one line
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)  # the restricted unpickler: no code runs
    except Exception as e:  # torch reports corrupt or refused files through many exception types
        raise _torch_refusal(path, head, e) from None
    if not isinstance(obj, Mapping):
        raise InvalidInputError(f"{describe(path)} holds a {type(obj).__name__}, not a state dict (name -> tensor)")
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str):
            raise InvalidInputError(f"{describe(path)}: key {describe(repr(k))} is not a string")
        if not isinstance(v, torch.Tensor):
            raise InvalidInputError(
                f"{describe(path)}: entry {describe(repr(k))} is a {type(v).__name__}, not a tensor "
                "(the file must hold a flat state dict)"
            )
        if v.layout != torch.strided or v.is_quantized or v.is_nested:
            raise InvalidInputError(f"{describe(path)}: tensor {describe(repr(k))} is not a dense tensor")
        check_shape(path, k, v.shape)
        if v.numel() * v.element_size() > v.untyped_storage().nbytes():  # (a stride of 0, or strides that overlap)
            raise InvalidInputError(
                f"{describe(path)}: tensor {describe(repr(k))} is a view that repeats its storage's elements "
                f"({v.numel()} elements over a storage of {v.untyped_storage().nbytes()} bytes); save it contiguous"
            )
        out[k] = v.resolve_conj().resolve_neg()  # (a lazily negated or conjugated view: its values, as they read)
    return out


def _write_torch(f: Any, tensors: Mapping[str, Any]) -> None:
    torch = _torch("output")
    torch.save({k: as_torch(v) for k, v in tensors.items()}, f)


# --- safetensors -----------------------------------------------------------------------------------------------


def _safetensors(path: str) -> Any:
    try:
        import safetensors
    except ImportError:
        raise InvalidInputError(
            f"{describe(path)}: .safetensors needs the safetensors package (pip install 'gpu_codec[cli]')"
        ) from None
    return safetensors


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _read_safetensors(path: str) -> dict[str, Any]:
    st = _safetensors(path)
    framework = "pt" if _has_torch() else "numpy"  # torch reads bfloat16, NumPy cannot
    try:
        with st.safe_open(path, framework=framework) as f:
            out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as e:  # SafetensorError, or NumPy refusing a dtype it lacks
        raise InvalidInputError(f"{describe(path)}: not a readable .safetensors file ({_first_line(e)})") from None
    for k, t in out.items():
        check_shape(path, k, tuple(t.shape))
    return out


def _unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """The tensors, each holding its own memory: safetensors refuses tensors that share a storage (a checkpoint's
    tied weights, or counters that are one tensor under two names); those after the first, and views of a larger
    storage, are copied."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if (ptr in seen and storage.nbytes()) or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def _write_safetensors(f: Any, tensors: Mapping[str, Any]) -> None:
    _safetensors("output")
    if "__metadata__" in tensors:
        raise InvalidInputError("a tensor named '__metadata__' cannot be stored in .safetensors (the name is reserved)")
    if any(not isinstance(v, np.ndarray) for v in tensors.values()):
        from safetensors.torch import save

        ts = {k: as_torch(v).contiguous() for k, v in tensors.items()}
        try:
            data = save(_unshared(ts))
        except KeyError as e:  # (safetensors' table of dtypes has no entry for this one: complex32, say)
            bad = next((k for k, t in ts.items() if t.dtype == e.args[0]), None) if e.args else None
            what = f"tensor {describe(repr(bad))} is {describe(e.args[0])}" if bad is not None else describe(e)
            raise InvalidInputError(f"cannot be written as .safetensors: {what}, a dtype it does not store") from None
    else:
        from safetensors.numpy import save

        data = save({k: np.asarray(v, order="C") for k, v in tensors.items()})
    f.write(data)
