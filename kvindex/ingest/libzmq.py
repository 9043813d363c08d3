"""The libzmq behind pyzmq's sockets, reached directly for the one hot read: a socket's queued messages.

``native_queued()`` gives a reader of the same shape as ``transport.queued`` (the reference, on
pyzmq's own calls): ``reader(handle)(limit)`` is up to ``limit`` queued messages, each its parts.
It reads them in one native call (``kvindex.ingest._drain``), a part for one ``zmq_msg_recv``.
``native_bursts(parse, overhead)`` gives one of ``transport.queued_bursts``'s shape (``burst_of``
the queued messages: parsed, counted): the common message's ``Frame`` made natively, any other
one's parts handed to ``parse``, in the same call.

Invariants:
- The library is the libzmq shared object mapped into this process once pyzmq is imported
  (``/proc/self/maps``; exactly one, or none is used), opened by path (the same mapping, no second
  copy). Before it serves, it is proven to be the one pyzmq's sockets live in: its version is
  pyzmq's ``zmq_version_info()``, and a socket pyzmq made and gave a receive high-water mark reads
  that mark back through it.
- Anything missing (the accelerator not built, no ``/proc``, a pyzmq with libzmq linked in
  statically, a failed proof) gives None, and the reason is logged: the caller then reads
  through pyzmq. Nothing is cached here; each process's composition root asks once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from kvindex import native
from kvindex.events import Frame
from kvindex.limits import MAX_TOPIC_BYTES

log = logging.getLogger("kvindex.ingest.transport")

Reader = Callable[[int], Callable[[int], list[list[bytes]]]]  # socket handle -> (limit -> messages' parts)
BurstReader = Callable[[int], Callable[[int], tuple[list[Any], int, int]]]  # handle -> (limit -> burst_of them)
PROBE_HWM = 4_321  # an unusual receive high-water mark, set through pyzmq, read through the library
_RCVHWM = 24  # ZMQ_RCVHWM
_FUNCTIONS = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_close", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more")


def mapped_libzmq(maps: str) -> list[str]:
    """The distinct libzmq shared objects in a ``/proc/<pid>/maps`` text."""
    paths = {line.split(None, 5)[5].strip() for line in maps.splitlines() if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if Path(p).name.startswith("libzmq") and ".so" in Path(p).name)


def _open() -> tuple[ctypes.CDLL | None, str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError as exc:
        return None, f"cannot read /proc/self/maps ({exc})"
    found = mapped_libzmq(maps)
    if len(found) != 1:
        return None, ("no libzmq shared library is mapped (pyzmq links it statically)" if not found
                      else f"{len(found)} libzmq libraries are mapped: {', '.join(found)}")
    try:
        return ctypes.CDLL(found[0]), found[0]
    except OSError as exc:
        return None, f"cannot open {found[0]} ({exc})"


def _proven(lib: ctypes.CDLL) -> str | None:
    """Why ``lib`` is not the libzmq of pyzmq's sockets; None when it is."""
    major, minor, patch = (ctypes.c_int(), ctypes.c_int(), ctypes.c_int())
    lib.zmq_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
    if (major.value, minor.value, patch.value) != zmq.zmq_version_info():
        return f"its version {major.value}.{minor.value}.{patch.value} is not pyzmq's {zmq.zmq_version()}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.RCVHWM, PROBE_HWM)
        value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        lib.zmq_getsockopt.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
        rc = lib.zmq_getsockopt(sock.underlying, _RCVHWM, ctypes.byref(value), ctypes.byref(size))
        return None if rc == 0 and value.value == PROBE_HWM else "a pyzmq socket reads back otherwise through it"
    finally:
        sock.close(linger=0)
        ctx.term()


def native_queued() -> Reader | None:
    """The native reader, or None (pyzmq's calls read), saying why in the log."""
    library, why = _library()
    if library is None:
        log.info("queued engine messages are read through pyzmq's calls (slower): %s", why)
        return None

    def reader(handle: int) -> Callable[[int], list[list[bytes]]]:
        return functools.partial(library.drain, handle)

    log.debug("queued messages are read through %s", why)
    return reader


def native_bursts(parse: Callable[[list[bytes]], Any], overhead: int) -> BurstReader | None:
    """The native burst reader (``parse``: ``transport.parse_message``; ``overhead``: the bytes a
    message counts beyond its parts), or None (pyzmq's calls read), saying why in the log."""
    library, why = _library()
    if library is None:
        log.info("queued engine messages are read through pyzmq's calls (slower): %s", why)
        return None
    drain = library.drain_frames

    def reader(handle: int) -> Callable[[int], tuple[list[Any], int, int]]:
        return lambda limit: drain(handle, limit, Frame, parse, MAX_TOPIC_BYTES, overhead)

    log.debug("queued messages are read and framed through %s", why)
    return reader


def _library() -> tuple[Any, str]:
    """The native drain bound to pyzmq's libzmq and the library's path, or None and why not."""
    drain = native.load("kvindex.ingest._drain")
    if drain is None:
        return None, "kvindex.ingest._drain is not in use (" + (
            "KVINDEX_PURE_PYTHON is set)" if native.pure_python() else f"not built: {native.fix(['kvindex.ingest._drain'])})")
    lib, where = _open()
    if lib is None:
        return None, where
    why = _proven(lib)
    if why is not None:
        return None, f"{where}: {why}"
    return drain.Library(tuple(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value for f in _FUNCTIONS)), where
