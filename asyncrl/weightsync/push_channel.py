"""A direct socket from the publisher to an engine replica for the one call on every push's critical path: its load.

Owns: `ChannelServer` (the replica's side, on its own event loop, running the verbs it was given as a Ray or Serve call
would), `ChannelClient` (the publisher's: one connection per replica, calls matched to replies by id), `BlockingChannel`
/ `call_once` (the client of a thread without an event loop) and `ThreadServer` (the protocol served by an engine
worker's threads, so a receive apart starts without waiting in the engine's input queue). Frames: an 8-byte length and
a pickle; a connection's first frame is its token. Why: a Ray or Serve call costs a round trip before a push's first
byte and after its last, each about as long as the whole wire for a small model.
Must never: run a verb it was not given, read a frame before the token was checked (a connection without it is closed
unread), or leave a call waiting on a connection that is gone (every call in flight fails with `ChannelClosed` the
moment it drops; the caller falls back to Ray or Serve next time).
Details: docs/design/weightsync.md, "The push channel".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import pickle
import secrets
import struct
from collections.abc import Iterable
from typing import Any

from asyncrl.types import Endpoint

_LEN = struct.Struct("!Q")
RECEIVE_DONE = "receive_done"  # the replica's verb a worker's receive apart from the engine reports its end to
WIRE_END = "wire_end"  # ... and the one it reports its last bucket landed to (before its digests are read)
_TOKEN_MAX = 256  # bytes: the first frame is a token, read before anything is trusted
_FRAME_MAX = 1 << 30  # a call's arguments travel by value (the load's payload is a small dataclass)


class ChannelClosed(ConnectionError):
    """The connection to the replica is gone: the call may or may not have run there."""


async def _read_frame(reader: asyncio.StreamReader, limit: int = _FRAME_MAX) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > limit:
        raise ValueError(f"push channel: a frame of {n} bytes (at most {limit})")
    return await reader.readexactly(n)


def _frame(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def node_host(fallback: str = "127.0.0.1") -> str:
    """This node's address as Ray knows it (where other nodes reach a channel here), else `fallback` (not in a Ray
    process: a local test, or a vLLM worker process, which runs on its replica's node)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray process
        pass
    return fallback


def _check_served(verbs: frozenset[str], verb: str, what: str) -> None:
    if verb not in verbs:
        raise ValueError(f"{what}: {verb!r} is not served here (only {sorted(verbs)})")


def _reply_data(call_id: int, verb: str, ok: bool, value: Any, what: str) -> bytes:
    """A reply's frame body: (id, ok, result or exception), or, where that does not pickle, an error saying so."""
    try:
        return pickle.dumps((call_id, ok, value))
    except Exception as err:  # noqa: BLE001 - an unpicklable result or exception: say what it was
        return pickle.dumps((call_id, False, RuntimeError(f"{what}: reply of {verb!r} not picklable: "
                                                          f"{type(err).__name__}: {err}; {value!r:.500}")))


class ChannelServer:
    """Serves `verbs` (names of coroutine methods of `target`) to clients that present the token."""

    def __init__(self, target: Any, verbs: Iterable[str]) -> None:
        self._target, self._verbs = target, frozenset(verbs)
        self._server: asyncio.base_events.Server | None = None
        self._token = secrets.token_hex(16)
        self._address: Endpoint | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._starting: asyncio.Lock | None = None

    async def address(self, host: str) -> Endpoint:
        """Where it listens; the server starts (on the running loop) at the first call."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:  # (two first asks start one server)
            if self._address is None:
                self._server = await asyncio.start_server(self._serve, host=host, port=0)
                port = self._server.sockets[0].getsockname()[1]
                self._address = Endpoint(host, int(port), self._token)
            return self._address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        write_lock = asyncio.Lock()
        running: set[asyncio.Task] = set()
        try:
            token = await _read_frame(reader, _TOKEN_MAX)
            if not hmac.compare_digest(token, self._token.encode()):
                return
            while True:
                call_id, verb, args = pickle.loads(await _read_frame(reader))
                task = asyncio.ensure_future(self._run(call_id, verb, args, writer, write_lock))
                running.add(task)
                task.add_done_callback(running.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away (its calls already running finish; their replies have nowhere to go)
        except Exception as err:  # noqa: BLE001 - a malformed frame: that connection ends, the server stays
            logging.getLogger(__name__).warning("push channel: connection dropped: %s: %s", type(err).__name__, err)
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _run(self, call_id: int, verb: str, args: tuple, writer: asyncio.StreamWriter,
                   write_lock: asyncio.Lock) -> None:
        try:
            _check_served(self._verbs, verb, "push channel")
            outcome = (True, await getattr(self._target, verb)(*args))
        except Exception as err:  # noqa: BLE001 - the caller gets the exception, as a Ray call would
            outcome = (False, err)
        data = _reply_data(call_id, verb, *outcome, "push channel")
        with contextlib.suppress(ConnectionError):
            async with write_lock:
                writer.write(_frame(data))
                await writer.drain()

    def close(self) -> None:
        """Stop listening and drop every connection (their calls in flight fail on the client's side)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        self._server, self._address = None, None


class ChannelClient:
    """One connection to a replica's `ChannelServer`. `call` may be awaited concurrently."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self._reader, self._writer, self.name = reader, writer, name
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._closed: BaseException | None = None
        self._replies = asyncio.ensure_future(self._read_replies())

    @classmethod
    async def connect(cls, address: Endpoint, name: str = "", timeout_s: float = 10.0) -> "ChannelClient":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:  # small frames both ways: no Nagle delay
            import socket

            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(_frame(address.token.encode()))
        await writer.drain()
        return cls(reader, writer, name or f"{address.host}:{address.port}")

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def _read_replies(self) -> None:
        try:
            while True:
                call_id, ok, value = pickle.loads(await _read_frame(self._reader))
                future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    (future.set_result if ok else future.set_exception)(value)
        except BaseException as err:  # noqa: BLE001 - every way the connection ends fails the calls in flight
            self._fail(ChannelClosed(f"push channel to {self.name}: connection lost ({type(err).__name__}: {err})"))
            if isinstance(err, asyncio.CancelledError):
                raise

    def _fail(self, err: ChannelClosed) -> None:
        if self._closed is None:
            self._closed = err
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(err)
        self._writer.close()

    async def call(self, verb: str, *args: Any) -> Any:
        """`verb(*args)` on the replica's loop; its result, or its exception raised here. Raises
        `ChannelClosed` if the connection is (or goes) away before the reply."""
        if self._closed is not None:
            raise ChannelClosed(str(self._closed))
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._writer.write(_frame(pickle.dumps((call_id, verb, args))))
            await self._writer.drain()
        except ConnectionError as err:
            self._fail(ChannelClosed(f"push channel to {self.name}: {type(err).__name__}: {err}"))
        try:
            return await future
        finally:
            self._pending.pop(call_id, None)

    def close(self) -> None:
        self._fail(ChannelClosed(f"push channel to {self.name}: closed"))
        self._replies.cancel()


class BlockingChannel:
    """One connection to a `ChannelServer` from a thread without an event loop. `post` sends a call and returns at
    once (its reply is read, and dropped, by a later `call`); `call` sends one and waits for its reply, its result
    returned or its exception raised. `ChannelClosed` if the connection fails."""

    def __init__(self, address: Endpoint, timeout_s: float = 30.0) -> None:
        import socket

        self.name = f"{address.host}:{address.port}"
        self._ids = itertools.count()
        try:
            self._sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(_frame(address.token.encode()))
        except OSError as err:
            raise ChannelClosed(f"push channel to {self.name}: {type(err).__name__}: {err}") from err

    def post(self, verb: str, *args: Any) -> int:
        call_id = next(self._ids)
        try:
            self._sock.sendall(_frame(pickle.dumps((call_id, verb, args))))
        except OSError as err:
            raise ChannelClosed(f"push channel to {self.name}: {type(err).__name__}: {err}") from err
        return call_id

    def call(self, verb: str, *args: Any) -> Any:
        call_id = self.post(verb, *args)
        try:
            while True:
                got, ok, value = pickle.loads(_recv_frame(self._sock))
                if got == call_id:
                    break  # (earlier replies: posted calls', not waited for)
        except (OSError, ValueError) as err:  # (a ValueError: a reply over the frame limit)
            raise ChannelClosed(f"push channel to {self.name}: {type(err).__name__}: {err}") from err
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "BlockingChannel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ThreadServer:
    """`ChannelServer`'s protocol served from threads, for a process whose event loop is not ours (an engine
    worker): a listening thread, and one thread per connection that runs each call (`verbs`: names of plain
    methods of `target`, which should return at once) in the order its frames came and writes its reply.
    The connection's first frame must be the token, as with `ChannelServer`. Daemon threads: they end with the
    process, or at `close`."""

    def __init__(self, target: Any, verbs: Iterable[str], host: str) -> None:
        import socket
        import threading

        self._target, self._verbs = target, frozenset(verbs)
        self._token = secrets.token_hex(16)
        self._sock = socket.create_server((host, 0))
        self.address = Endpoint(host, int(self._sock.getsockname()[1]), self._token)
        self._closed = False
        self._connections: set[Any] = set()
        threading.Thread(target=self._accept, name="asyncrl-worker-channel", daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="asyncrl-worker-channel-conn", daemon=True).start()

    def _serve(self, conn: Any) -> None:
        self._connections.add(conn)
        try:
            if not hmac.compare_digest(_recv_frame(conn, _TOKEN_MAX), self._token.encode()):
                return
            while not self._closed:
                call_id, verb, args = pickle.loads(_recv_frame(conn))
                try:
                    _check_served(self._verbs, verb, "worker channel")
                    outcome = (True, getattr(self._target, verb)(*args))
                except Exception as err:  # noqa: BLE001 - the caller gets the exception, as over vLLM's RPC
                    outcome = (False, err)
                conn.sendall(_frame(_reply_data(call_id, verb, *outcome, "worker channel")))
        except (ConnectionError, OSError):
            pass  # the client went away
        except Exception as err:  # noqa: BLE001 - a malformed frame: that connection ends, the server stays
            logging.getLogger(__name__).warning("worker channel: connection dropped: %s: %s", type(err).__name__, err)
        finally:
            self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop listening and drop every connection (their calls in flight fail on the client's side)."""
        import socket

        self._closed = True
        for sock in [self._sock, *list(self._connections)]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread blocked on it; a close alone would not)
            sock.close()


def call_once(address: Endpoint, verb: str, *args: Any, timeout_s: float = 30.0) -> Any:
    """`verb(*args)` on the server at `address` from a thread without an event loop: one
    connection, one call, its result (or its exception raised here); `ChannelClosed` if the connection fails."""
    with BlockingChannel(address, timeout_s) as channel:
        return channel.call(verb, *args)


def _recv_frame(sock: Any, limit: int = _FRAME_MAX) -> bytes:
    """`_read_frame` on a blocking socket."""
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    if n > limit:
        raise ValueError(f"push channel: a frame of {n} bytes (at most {limit})")
    return _recv_exactly(sock, n)


def _recv_exactly(sock: Any, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the channel closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
