"""Read memory snapshots safely, whatever wrote them.

A snapshot is a pickle written by ``torch.cuda.memory._dump_snapshot`` (the dict format with ``segments`` and
``device_traces``), by the older ``torch.cuda.memory_snapshot()`` (a bare list of segments), by MemTrace (the dict
format plus a ``"memtrace"`` key and per-event ``category``/``user_metadata``), possibly gzip-compressed, embedded
as base64 in the HTML page that ``torch.cuda._memory_viz`` writes, or saved with ``torch.save`` (a zip archive whose
``data.pkl`` is the snapshot's pickle).

Snapshots come from other people: they are unpickled by :class:`RestrictedUnpickler`, which builds plain containers
and scalars only and refuses any pickle that names a Python object (which is how a pickle runs code). Every bad input
raises :class:`SnapshotError` with a one-line message.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import pickle
import re
import select
import stat
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_memtrace.analysis.data_limit import data_growth_capped, unpickling_budget
from lightning_memtrace.collector import gc_paused
from lightning_memtrace.schema import read_header
from lightning_memtrace.units import format_bytes


#: Default cap on the bytes read (and, for gzip and HTML, decompressed/decoded) from one snapshot file.
DEFAULT_MAX_BYTES = 8 * 1024**3

#: Above this size a progress bar is shown while reading (when a ``progress`` callback is given).
PROGRESS_THRESHOLD_BYTES = 16 * 1024**2

_CHUNK = 4 * 1024**2

#: How long a named pipe may stay silent (no writer, nothing written) before the loader gives up on it, in seconds.
PIPE_WAIT_SECONDS = 60.0

#: The only globals a snapshot pickle may name: harmless constructors of plain containers.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("__builtin__", "set"): set,
    ("__builtin__", "frozenset"): frozenset,
    ("collections", "OrderedDict"): dict,
}


class SnapshotError(ValueError):
    """A file that is not a readable memory snapshot. The message is one line, fit for ``memtrace: error: ...``."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, sets, strings, bytes and numbers only.

    Any other global (``os.system``, a class of some package, ``torch._utils._rebuild_tensor``...) is refused with
    :class:`SnapshotError` before it is imported, so no code from the file runs.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise SnapshotError(
                f"refused to unpickle: the file asks for the Python object {module}.{name}; "
                "a memory snapshot holds only plain data (dicts, lists, strings, numbers)"
            )
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError("refused to unpickle: the file uses persistent ids; a memory snapshot never does")


@dataclasses.dataclass
class Snapshot:
    """A loaded snapshot, normalised to the current dict format.

    Attributes:
        data: ``{"segments": [...], "device_traces": [[...], ...], ...}``; every other key of the file is kept.
        path: Where it was read from.
        container: How it was stored: ``"pickle"``, ``"gzip"``, ``"html"`` or ``"torch.save"``.
        layout: ``"dict"`` (current format) or ``"segment-list"`` (the old bare list of segments, no trace).
    """

    data: dict[str, Any]
    path: Path | None = None
    container: str = "pickle"
    layout: str = "dict"

    @property
    def segments(self) -> list[dict[str, Any]]:
        return self.data["segments"]

    @property
    def device_traces(self) -> list[list[dict[str, Any]]]:
        return self.data["device_traces"]

    @property
    def memtrace(self) -> dict[str, Any] | None:
        """MemTrace's own header (``format``, ``device``, ``rank``, ``steps``, ``phases``...), or None."""
        return read_header(self.data)

    @property
    def external_annotations(self) -> list[dict[str, Any]]:
        value = self.data.get("external_annotations")
        return [a for a in value if isinstance(a, dict)] if isinstance(value, list) else []

    @property
    def allocator_settings(self) -> dict[str, Any]:
        value = self.data.get("allocator_settings")
        return value if isinstance(value, dict) else {}

    @property
    def num_events(self) -> int:
        return sum(len(t) for t in self.device_traces)

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else "<snapshot>"


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_magic(head: bytes) -> str | None:
    """A short name for well-known non-snapshot file types, from their first bytes."""
    magics = {
        b"\x89PNG": "a PNG image",
        b"\xff\xd8\xff": "a JPEG image",
        b"GIF8": "a GIF image",
        b"%PDF": "a PDF document",
        b"PK\x03\x04": "a zip archive (a torch.save checkpoint?)",
        b"\x7fELF": "an executable",
        b"SQLite format": "an SQLite database",
    }
    for magic, what in magics.items():
        if head.startswith(magic):
            return what
    return None


#: The first bytes of a zip archive, which ``torch.save`` writes.
_ZIP_MAGIC = b"PK\x03\x04"
#: What ``zipfile`` raises for a corrupt archive (its headers' numbers are read as they stand).
_CORRUPT_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    NotImplementedError,
    EOFError,
    OSError,
    ValueError,
    OverflowError,
    RuntimeError,  # an encrypted entry
)


def _pickle_saved_by_torch(raw: bytes, where: str, max_bytes: int) -> bytes:
    """The pickle inside a ``torch.save`` archive (its one ``<name>/data.pkl``), read within ``max_bytes``.

    A snapshot saved so holds no tensors: a pickle that holds one (it names torch's rebuild functions) is refused when
    unpickled, as any other.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            names = [info for info in archive.infolist() if info.filename.rsplit("/", 1)[-1] == "data.pkl"]
            if len(names) != 1:
                raise SnapshotError(f"{where}: a zip archive, not a memory snapshot (nor a torch.save file)")
            if names[0].file_size > max_bytes:
                raise SnapshotError(
                    f"{where}: its data.pkl is {format_bytes(names[0].file_size)}, over the size limit of "
                    f"{format_bytes(max_bytes)} (raise it with max_bytes / --max-bytes)"
                )
            with archive.open(names[0]) as member:
                data = member.read(max_bytes + 1)
    except SnapshotError:
        raise
    except _CORRUPT_ZIP_ERRORS as error:
        raise SnapshotError(f"{where}: corrupt zip archive ({_one_line(str(error))})") from None
    if len(data) > max_bytes:
        raise SnapshotError(f"{where}: its data.pkl is over the size limit of {format_bytes(max_bytes)}")
    return data


#: What a file that is none of the containers a snapshot comes in is told.
_NOT_A_SNAPSHOT_FILE = "not a pickle (nor gzip, nor memory_viz HTML)"
#: First bytes of each container a snapshot comes in: a pickle (protocol 2 and above; 0 and 1 open a dict, a list or a
#: mark), gzip, and HTML (after any whitespace).
#: First bytes of the binary containers a snapshot comes in: a pickle (protocol 2 on), gzip, ``torch.save``'s zip.
SNAPSHOT_BINARY_HEADS = (b"\x80", b"\x1f\x8b", _ZIP_MAGIC)
_CONTAINER_HEADS = (*SNAPSHOT_BINARY_HEADS, b"}", b"]", b"(", b"<")


def _refuse_foreign_head(head: bytes, where: str) -> None:
    """Refuse a file from its first bytes where they are none of a snapshot's containers, before reading the rest (a
    multi-GB file of something else, a pipe that never ends)."""
    what = None if head.startswith(_ZIP_MAGIC) else _describe_magic(head[:16])
    if what is not None:
        raise SnapshotError(f"{where}: {what}, not a memory snapshot")
    if head and not head.lstrip().startswith(_CONTAINER_HEADS):
        raise SnapshotError(f"{where}: {_NOT_A_SNAPSHOT_FILE}")


def _open_pipe(path: Path) -> Any:
    """Open a named pipe for reading once something is written into it, or its writer has come and gone.

    A plain open of a pipe that no process writes into waits for ever (``memtrace report`` on a stray ``mkfifo``):
    opened without waiting, the pipe is watched for at most :data:`PIPE_WAIT_SECONDS`, then read as usual. A pipe of
    the shell's (``<(zcat run.pickle.gz)``) has its writer already and goes straight on. Linux only: elsewhere ``poll``
    on a pipe is unreliable, and the open waits as before.
    """
    if not sys.platform.startswith("linux"):
        return open(path, "rb")
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        watcher = select.poll()
        watcher.register(descriptor, select.POLLIN | select.POLLHUP)
        if not watcher.poll(int(PIPE_WAIT_SECONDS * 1000)):
            raise SnapshotError(f"{path}: a pipe with nothing written into it for {PIPE_WAIT_SECONDS:g} s")
        os.set_blocking(descriptor, True)
        return open(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _read_capped(path: Path, max_bytes: int, progress: Callable[[int, int], None] | None) -> bytes:
    status = path.stat()
    size = status.st_size
    if size > max_bytes:
        raise SnapshotError(
            f"{path}: {format_bytes(size)} is over the size limit of {format_bytes(max_bytes)} "
            "(raise it with max_bytes / --max-bytes)"
        )
    with _open_pipe(path) if stat.S_ISFIFO(status.st_mode) else open(path, "rb") as handle:
        head = handle.read(4096)
        _refuse_foreign_head(head, str(path))
        if progress is None or size < PROGRESS_THRESHOLD_BYTES:
            if handle.seekable():  # read whole at once: no copy of a large file to join the head to it
                handle.seek(0)
                return handle.read(max_bytes + 1)
            return head + handle.read(max_bytes + 1 - len(head))
        buffer = bytearray(head)
        progress(len(buffer), size)
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                break
            buffer += chunk
            progress(len(buffer), size)
        return bytes(buffer)


def _gunzip_capped(raw: bytes, max_bytes: int, where: str) -> bytes:
    decompressor = zlib.decompressobj(wbits=31)
    out = bytearray()
    try:
        pos = 0
        while pos < len(raw):
            chunk = raw[pos : pos + _CHUNK]
            pos += _CHUNK
            out += decompressor.decompress(chunk, max_bytes + 1 - len(out))
            if len(out) > max_bytes or decompressor.unconsumed_tail:
                raise SnapshotError(
                    f"{where}: decompresses to over the size limit of {format_bytes(max_bytes)} "
                    "(raise it with max_bytes / --max-bytes)"
                )
        out += decompressor.flush()
    except zlib.error as error:
        raise SnapshotError(f"{where}: corrupt gzip data ({_one_line(str(error))})") from None
    if not decompressor.eof:
        raise SnapshotError(f"{where}: truncated gzip file")
    return bytes(out)


_BASE64_RE = re.compile(rb'"base64"\s*:\s*"([A-Za-z0-9+/=\\n]+)"')
_ANY_BASE64_RE = re.compile(rb"([A-Za-z0-9+/]{64,}={0,2})")


def _extract_from_html(raw: bytes, where: str, max_bytes: int) -> bytes:
    """The pickle embedded (base64) in a page written by ``torch.cuda._memory_viz``."""
    candidates = [m.group(1).replace(b"\\n", b"") for m in _BASE64_RE.finditer(raw)]
    if not candidates:
        candidates = [m.group(1) for m in _ANY_BASE64_RE.finditer(raw)]
    if not candidates:
        raise SnapshotError(f"{where}: an HTML file without an embedded snapshot (not written by torch memory_viz?)")
    encoded = max(candidates, key=len)
    if len(encoded) * 3 // 4 > max_bytes:
        raise SnapshotError(f"{where}: the embedded snapshot is over the size limit of {format_bytes(max_bytes)}")
    try:
        return base64.b64decode(encoded, validate=False)
    except (binascii.Error, ValueError) as error:
        raise SnapshotError(f"{where}: the embedded snapshot is not valid base64 ({_one_line(str(error))})") from None


def unpickle_restricted(raw: bytes, where: str = "<bytes>") -> Any:
    """Unpickle ``raw`` with :class:`RestrictedUnpickler`.

    Args:
        raw: The pickle's bytes.
        where: Named in error messages.

    Returns:
        The plain Python value.

    Raises:
        SnapshotError: The pickle names a Python object, is truncated or is not a pickle.
    """
    if not raw:
        raise SnapshotError(f"{where}: empty file")
    return _unpickle_stream(io.BytesIO(raw), where, raw[:1] == b"\x80", len(raw))


def _unpickle_stream(stream: Any, where: str, pickle_magic: bool, size: int) -> Any:
    """:func:`unpickle_restricted` of a binary stream of ``size`` bytes (in memory, or an open file read as it goes),
    with the process's memory growth capped meanwhile (see :mod:`~lightning_memtrace.analysis.data_limit`)."""
    try:
        with gc_paused(), data_growth_capped(unpickling_budget(size)):
            return RestrictedUnpickler(stream).load()
    except SnapshotError as error:
        raise SnapshotError(f"{where}: {error}") from None
    except EOFError:
        raise SnapshotError(f"{where}: truncated pickle (the file ends before the snapshot does)") from None
    except MemoryError:
        raise SnapshotError(
            f"{where}: corrupt or hostile pickle (it asks for more memory than a pickle of {format_bytes(size)} can "
            "need)"
        ) from None
    except RecursionError:
        raise SnapshotError(f"{where}: pickle nested too deeply") from None
    except Exception as error:  # pickle raises many types for corrupt input
        if not pickle_magic:
            raise SnapshotError(f"{where}: {_NOT_A_SNAPSHOT_FILE}") from None
        raise SnapshotError(
            f"{where}: corrupt or truncated pickle ({type(error).__name__}: {_one_line(str(error))})"
        ) from None


def _is_segment(value: Any) -> bool:
    return isinstance(value, dict) and ("blocks" in value or "total_size" in value) and "address" in value


def normalize(value: Any, where: str = "<snapshot>") -> tuple[dict[str, Any], str]:
    """Bring an unpickled value to the current dict format.

    Args:
        value: What the pickle held.
        where: Named in error messages.

    Returns:
        ``(data, layout)``: ``data`` always has a list ``segments`` and a list of lists ``device_traces`` (events are
        dicts with at least ``action``); ``layout`` is ``"dict"`` or ``"segment-list"``.

    Raises:
        SnapshotError: The value is not a memory snapshot.
    """
    layout = "dict"
    if isinstance(value, list):
        if value and not all(_is_segment(s) for s in value[:50]):
            raise SnapshotError(f"{where}: a pickled list, but not of memory segments")
        value = {"segments": value, "device_traces": []}
        layout = "segment-list"
    if not isinstance(value, dict):
        raise SnapshotError(f"{where}: a pickle of {type(value).__name__}, not a memory snapshot")
    if "segments" not in value and "device_traces" not in value:
        keys = ", ".join(sorted(str(k) for k in list(value)[:8]))
        raise SnapshotError(f"{where}: a pickled dict without 'segments' or 'device_traces' (keys: {keys})")
    data = dict(value)
    segments = _checked_segments(data.get("segments") or [], where)
    data["segments"] = segments
    data["device_traces"] = _checked_traces(data.get("device_traces") or [], where)
    return data, layout


def _checked_segments(segments: Any, where: str) -> list[dict[str, Any]]:
    """The segments, each with a ``blocks`` list (blocks of torch 2.0's format brought to today's fields)."""
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        raise SnapshotError(f"{where}: 'segments' is not a list of segment dicts")
    for segment in segments:
        blocks = segment.get("blocks")
        if blocks is None:
            segment["blocks"] = []
        elif not isinstance(blocks, list):
            raise SnapshotError(f"{where}: a segment's 'blocks' is not a list")
        elif blocks and isinstance(blocks[0], dict) and "address" not in blocks[0]:
            _fill_legacy_blocks(segment)
    return segments


def _fill_legacy_blocks(segment: dict[str, Any]) -> None:
    """Give torch 2.0's blocks the fields later torch writes: ``address`` (the segment's address plus the sizes of the
    blocks before it, as torch's own viewer reads them), and ``frames`` / ``requested_size`` from the newest entry of
    their ``history``. Without an address, a block that the trace allocated would be counted twice: once by its
    ``alloc`` event and once as alive before recording began."""
    offset = _whole(segment.get("address"))
    for block in segment["blocks"]:
        if not isinstance(block, dict):
            continue
        if offset is not None:
            block.setdefault("address", offset)
            size = _whole(block.get("size"))
            offset = offset + size if size is not None and size >= 0 else None
        history = block.get("history")
        newest = history[0] if isinstance(history, list) and history and isinstance(history[0], dict) else None
        if newest is not None:
            block.setdefault("frames", newest.get("frames") or [])
            real_size = _whole(newest.get("real_size"))
            if real_size is not None:
                block.setdefault("requested_size", real_size)


def _whole(value: Any) -> int | None:
    """``value`` where it is a plain int (not a bool, a float or text from a hostile file), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: Device numbers a snapshot's traces may be keyed by: more GPUs than any machine has, far fewer than a hostile
#: key (``{"999999999": []}`` in a few bytes) would make lists for.
_MOST_DEVICES = 1024


def _device_number(key: Any) -> int | None:
    """A trace's key as a device number: an int or a string of digits, from 0 to ``_MOST_DEVICES - 1``, else None."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 4:
        key = int(key)
    number = _whole(key)
    return number if number is not None and 0 <= number < _MOST_DEVICES else None


def _traces_by_device(traces: dict[Any, Any], where: str) -> list[Any]:
    """Traces keyed by device number (some tools write them so) as a list."""
    by_number: dict[int, Any] = {}
    for key, trace in traces.items():
        number = _device_number(key)
        if number is None:
            raise SnapshotError(
                f"{where}: 'device_traces' keyed by something other than device numbers (0 to {_MOST_DEVICES - 1}): "
                f"{_one_line(repr(key), 40)}"
            )
        by_number[number] = trace
    return [by_number.get(number, []) for number in range(max(by_number) + 1 if by_number else 0)]


def _checked_traces(traces: Any, where: str) -> list[list[dict[str, Any]]]:
    """One list of event dicts per device (None → empty)."""
    if isinstance(traces, dict):
        traces = _traces_by_device(traces, where)
    if not isinstance(traces, list):
        raise SnapshotError(f"{where}: 'device_traces' is not a list")
    clean: list[list[dict[str, Any]]] = []
    for device, trace in enumerate(traces):
        trace = [] if trace is None else trace
        if not isinstance(trace, list):
            raise SnapshotError(f"{where}: the trace of device {device} is not a list")
        if trace and not (isinstance(trace[0], dict) and isinstance(trace[-1], dict)):
            raise SnapshotError(f"{where}: the trace of device {device} holds non-dict events")
        clean.append(trace)
    return clean


_NOT_PLAIN = object()


def _unpickle_plain_file(path: Path, max_bytes: int, where: str) -> Any:
    """A plain (uncompressed) pickle file unpickled as it is read, without a copy of its bytes in memory first;
    ``_NOT_PLAIN`` for anything else (gzip, HTML, empty, over the limit: the general path says what it is)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if not 0 < size <= max_bytes or handle.peek(2)[:2] not in _PICKLE_HEADS:
                return _NOT_PLAIN
            return _unpickle_stream(handle, where, True, size)
    except OSError as error:
        raise SnapshotError(f"{where}: cannot read ({_one_line(error.strerror or str(error))})") from None


#: The first two bytes of a pickle of protocol 2 to 5 (the protocols torch and MemTrace write).
_PICKLE_HEADS = frozenset(bytes([0x80, protocol]) for protocol in range(2, 6))


def load_snapshot(
    source: str | os.PathLike[str] | bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> Snapshot:
    """Load a snapshot file of any known variant.

    Args:
        source: A path to a pickle (``.pickle``/``.pkl``, gzip-compressed or not) or a memory_viz ``.html``, or the
            raw bytes of one.
        max_bytes: Refuse files (and decompressed/decoded contents) larger than this.
        progress: Called as ``progress(bytes_read, total_bytes)`` while reading a large file.

    Returns:
        The normalised :class:`Snapshot`.

    Raises:
        SnapshotError: Anything that is not a readable snapshot: missing file, directory, empty, truncated, too
            large, not a pickle, a pickle that names Python objects, a pickle of something else.
    """
    if isinstance(source, (bytes, bytearray)):
        path = None
        where = "<bytes>"
        raw = bytes(source)
        if len(raw) > max_bytes:
            raise SnapshotError(f"{where}: over the size limit of {format_bytes(max_bytes)}")
    else:
        path = Path(source)
        where = str(path)
        if not path.exists():
            raise SnapshotError(f"{where}: no such file")
        if path.is_dir():
            raise SnapshotError(f"{where}: is a directory, not a snapshot file")
        try:
            mode = path.stat().st_mode
        except OSError as error:
            raise SnapshotError(f"{where}: cannot read ({_one_line(error.strerror or str(error))})") from None
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            # a device reads without end (/dev/zero) or not at all; a pipe (<(zcat ...)) is read, its head checked
            raise SnapshotError(f"{where}: not a regular file (a device or socket), not a snapshot file")
        if progress is None and stat.S_ISREG(mode):
            # a pipe is opened once: a second open waits for a writer that left when the first open closed
            value = _unpickle_plain_file(path, max_bytes, where)
            if value is not _NOT_PLAIN:
                data, layout = normalize(value, where)
                return Snapshot(data=data, path=path, container="pickle", layout=layout)
        try:
            raw = _read_capped(path, max_bytes, progress)
        except OSError as error:
            raise SnapshotError(f"{where}: cannot read ({_one_line(error.strerror or str(error))})") from None
    if not raw:
        raise SnapshotError(f"{where}: empty file")
    container = "pickle"
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip_capped(raw, max_bytes, where)
        container = "gzip"
        if not raw:
            raise SnapshotError(f"{where}: empty file inside the gzip")
    if raw.startswith(_ZIP_MAGIC):
        raw = _pickle_saved_by_torch(raw, where, max_bytes)
        container = "torch.save"
    head = raw[:512].lstrip()
    if head[:1] == b"<" and (b"<html" in head.lower() or b"<!doctype" in head.lower() or b"<script" in raw[:4096]):
        raw = _extract_from_html(raw, where, max_bytes)
        container = "html"
    else:
        what = _describe_magic(raw[:16])
        if what is not None:
            raise SnapshotError(f"{where}: {what}, not a memory snapshot")
    value = unpickle_restricted(raw, where)
    del raw
    data, layout = normalize(value, where)
    return Snapshot(data=data, path=path, container=container, layout=layout)
