"""An engine's radixd calls made by a helper process: gRPC's threads and the Python each call runs leave the
engine's process, whose forward shares one GIL with every thread there. The engine's threads hand each call to
the relay as bytes over a socket of their own (no lock, no reader thread) and block in a system call, without
the GIL, until its answer is back; the session and the events stream live in the relay too. The relay exits
when the engine's end of its control socket closes or the engine process is gone (checked twice a second), and
with it the session: the server then drops its locks and held slots, as for any client that dies."""
from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Iterator, Optional

import grpc

from radixd.proto import cache_pb2 as pb

from .client import CacheClient, _Base
from .firsts import NO_EVENTS, READY, RESYNC, FirstPages
from .errors import NotFound, RadixdError, Unavailable, from_rpc_error

log = logging.getLogger("radixd.client")
SERVICE = "/radixd.v1.RadixCache/"
_CALL = struct.Struct("<HI")  # a call: method name length, request length (then the name, then the request)
_ANSWER = struct.Struct("<III")  # its answer: status code, details length, response length (then both)
_FRAME = struct.Struct("<I")  # an events frame: length (END: the stream ended; a status answer follows)
END = 0xFFFFFFFF
_BINDING = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_NUM_THREADS")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_RESPONSES = {m.name: getattr(pb, m.output_type.name)
              for m in pb.DESCRIPTOR.services_by_name["RadixCache"].methods}


def _recv(s: socket.socket, n: int) -> bytes:
    """Exactly n bytes (EOFError when the other end closed)."""
    buf = s.recv(n)
    if len(buf) == n:
        return buf
    if not buf:
        raise EOFError
    parts = [buf]
    have = len(buf)
    while have < n:
        b = s.recv(n - have)
        if not b:
            raise EOFError
        parts.append(b)
        have += len(b)
    return b"".join(parts)


class RelayError(grpc.RpcError):
    """A call's failure as the relay saw it (a grpc.RpcError, so code that catches those catches this)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class RelayedClient(CacheClient):
    """A CacheClient whose session and calls live in a relay process (`python -m radixd.client.relay`), started
    here with this thread's CPUs (start it beside the forward's, not on them). Every typed method works as on
    CacheClient; `watch_events` follows the events stream through it."""

    def __init__(self, target: str, *, token: Optional[str] = None, tls: Any = None, name: str = "python-client",
                 timeout: float = 30.0, start_timeout: float = 30.0):
        _Base.__init__(self, target, token, tls, name)
        self._timeout = timeout
        self._local = threading.local()
        self._mu = threading.Lock()  # the control socket (new connections)
        self._conns: list[socket.socket] = []
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message, one request
        pem = tls.decode("latin-1") if isinstance(tls, bytes) else None
        cfg = dict(target=target, token=token, tls=tls if isinstance(tls, (str, bool, type(None))) else None, pem=pem,
                   name=name, timeout=timeout, parent=os.getpid())
        # (not the forward's OpenMP binding: an engine's LD_PRELOADed OpenMP runtime would read it, and warn)
        env = {k: v for k, v in os.environ.items() if k not in _BINDING}
        # (radixd importable there as here, wherever this process found it)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.proc = subprocess.Popen([sys.executable, "-m", "radixd.client.relay", str(theirs.fileno())], env=env,
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self._ctl: Optional[socket.socket] = ours
        ours.settimeout(start_timeout)
        try:
            ours.sendall(json.dumps(cfg).encode())
            hello = json.loads(ours.recv(1 << 16) or b'{"error": "the relay exited", "code": 14}')
        except (OSError, ValueError) as e:
            self.proc.kill()
            self.proc.wait()
            raise Unavailable(f"UNAVAILABLE: the radixd relay process did not start ({e!r})") from None
        finally:
            ours.settimeout(None)
        if "error" in hello:
            self.proc.wait()
            raise from_rpc_error(RelayError(_CODES.get(hello["code"], grpc.StatusCode.UNKNOWN), hello["error"]))
        self.session_id, self.instance_id = hello["session_id"], hello["instance_id"]

    def _connect(self, kind: bytes, head: bytes = b"", *fds: int) -> socket.socket:
        """A new connection to the relay, served there by a thread of its own (with `fds` handed over too)."""
        ours, theirs = socket.socketpair()
        try:
            with self._mu:
                if self._ctl is None:
                    raise OSError("closed")
                socket.send_fds(self._ctl, [kind + head], [theirs.fileno(), *fds])
        except OSError:
            ours.close()
            raise Unavailable("UNAVAILABLE: the radixd relay process is gone") from None
        finally:
            theirs.close()
        with self._mu:
            self._conns.append(ours)
        return ours

    def _call(self, name: str, request):
        s = getattr(self._local, "conn", None)
        try:
            if s is None:
                s = self._local.conn = self._connect(b"C")
            raw = name.encode()
            body = request.SerializeToString()
            s.sendall(_CALL.pack(len(raw), len(body)) + raw + body)
            code, nd, nr = _ANSWER.unpack(_recv(s, _ANSWER.size))
            rest = _recv(s, nd + nr) if nd + nr else b""
        except (OSError, EOFError):
            self._local.conn = None
            raise self._seen(Unavailable("UNAVAILABLE: the radixd relay process is gone")) from None
        if code == 0:
            return _RESPONSES[name].FromString(rest)
        err = from_rpc_error(RelayError(_CODES.get(code, grpc.StatusCode.UNKNOWN), rest[:nd].decode()))
        if isinstance(err, NotFound) and "session" in str(err) and name != "GetInfo":
            try:
                current = self._call("GetInfo", pb.GetInfoRequest()).instance_id
            except RadixdError:
                current = ""
            err = self._restart_check(err, current)
        raise self._seen(err)

    def watch_events(self, request: pb.WatchEventsRequest) -> "RelayedStream":
        """The WatchEvents stream, read through the relay: an iterator of EventBatch with `cancel()`; a failure
        raises a grpc.RpcError (RelayError) with the server's status, as a gRPC stream does."""
        return RelayedStream(self._connect(b"W", request.SerializeToString()))

    def first_pages(self, media: Iterable[str], max_pages: int) -> FirstPages:
        """The first pages radixd holds on any of `media`, in a table in shared memory that the relay keeps from the
        events stream (a snapshot, then live batches): read here with no thread of this process involved."""
        table = FirstPages.create(max_pages)
        s = self._connect(b"F", json.dumps(sorted(media)).encode(), table.fd)
        s.close()  # (the relay holds the table's fd now; it follows until it exits)
        return table

    def attach(self) -> str:
        return self.session_id

    def session_events(self):
        raise RadixdError("a relayed client's session stream is read by its relay")

    transfer_events = session_events

    def reconnect(self) -> str:
        raise RadixdError("a relayed client's session is its relay's: make a new RelayedClient")

    def close(self) -> None:
        with self._mu:
            ctl, self._ctl = self._ctl, None
            conns, self._conns = self._conns, []
        if ctl is None:
            return
        for s in conns:
            s.close()
        ctl.close()  # the relay sees the end and exits (its session with it)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RelayedStream:
    """Events batches relayed as frames; `cancel()` ends the iteration (the relay drops the stream)."""

    def __init__(self, sock: socket.socket):
        self._s = sock
        self._cancelled = False

    def __iter__(self) -> Iterator[pb.EventBatch]:
        s = self._s
        try:
            while True:
                n = _FRAME.unpack(_recv(s, 4))[0]
                if n == END:
                    code, nd, _ = _ANSWER.unpack(_recv(s, _ANSWER.size))
                    raise RelayError(_CODES.get(code, grpc.StatusCode.UNKNOWN), _recv(s, nd).decode() if nd else "")
                yield pb.EventBatch.FromString(_recv(s, n) if n else b"")
        except (OSError, EOFError):
            raise RelayError(grpc.StatusCode.CANCELLED if self._cancelled else grpc.StatusCode.UNAVAILABLE,
                             "cancelled" if self._cancelled else "the radixd relay process is gone") from None

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self._s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _frame(b: bytes) -> bytes:
    return _FRAME.pack(len(b)) + b


# ------------------------------------------------------------------------------------------------ the relay side
def _serve_calls(conn: socket.socket, channel: grpc.Channel, meta: tuple, timeout: float) -> None:
    """One engine thread's calls, in order, as raw bytes both ways."""
    calls: dict[str, Any] = {}
    try:
        while True:
            nn, nb = _CALL.unpack(_recv(conn, _CALL.size))
            head = _recv(conn, nn + nb)
            name = head[:nn].decode()
            fn = calls.get(name)
            if fn is None:
                fn = calls[name] = channel.unary_unary(SERVICE + name)
            try:
                out, code, det = fn(head[nn:], metadata=meta, timeout=timeout), 0, b""
            except grpc.RpcError as e:
                out, code, det = b"", e.code().value[0], (e.details() or "").encode()
            conn.sendall(_ANSWER.pack(code, len(det), len(out)) + det + out)
    except (OSError, EOFError):
        pass
    finally:
        conn.close()


def _serve_events(conn: socket.socket, channel: grpc.Channel, meta: tuple, request: bytes) -> None:
    """One events stream, each batch forwarded as a frame, its end as a status."""
    call = channel.unary_stream(SERVICE + "WatchEvents")(request, metadata=meta)
    code, det = grpc.StatusCode.OK, b""

    def gone() -> None:  # the engine closed its end: drop the stream
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        call.cancel()

    threading.Thread(target=gone, daemon=True, name="relay-events-eof").start()
    try:
        for raw in call:
            conn.sendall(_frame(raw))
    except grpc.RpcError as e:
        code, det = e.code(), (e.details() or "").encode()
    except OSError:
        call.cancel()
        conn.close()
        return
    try:
        conn.sendall(_FRAME.pack(END) + _ANSWER.pack(code.value[0], len(det), 0) + det)
    except OSError:
        pass
    conn.close()


def _apply_first_pages(batch: pb.EventBatch, counts: dict, held: dict, media: set[str],
                       table: Optional[FirstPages]) -> None:
    """One batch's events on the first pages: `counts` per (medium, page), `held` per page over `media` (the pages
    whose block_hashes[0] has no parent; group 0 only, as the engines' lookups); the table follows `held`."""
    for ev in batch.events:
        kind = ev.WhichOneof("kind")
        if kind == "stored":
            s = ev.stored
            if s.group_idx or s.medium not in media or s.HasField("parent_block_hash") or not s.block_hashes:
                continue
            h = s.block_hashes[0]
            counts[s.medium, h] = counts.get((s.medium, h), 0) + 1
            n = held.get(h, 0)
            held[h] = n + 1
            if not n and table is not None:
                table.add(h)
        elif kind == "removed":
            r = ev.removed
            if r.group_idx or r.medium not in media:
                continue
            for h in r.block_hashes:
                n = counts.get((r.medium, h))
                if n is None:
                    continue
                if n > 1:
                    counts[r.medium, h] = n - 1
                else:
                    del counts[r.medium, h]
                if held[h] > 1:
                    held[h] -= 1
                else:
                    del held[h]
                    if table is not None:
                        table.remove(h)
        else:
            counts.clear()
            held.clear()
            if table is not None:
                table.reset(())


def _follow_first_pages(table: FirstPages, channel: grpc.Channel, meta: tuple, media: set[str]) -> None:
    """Keep the engine's first-pages table: a snapshot, then live batches in order; a gap, a loss or a broken
    stream marks it not current and takes a new snapshot (a second later)."""
    watch = channel.unary_stream(SERVICE + "WatchEvents", response_deserializer=pb.EventBatch.FromString)
    request = pb.WatchEventsRequest(follow=True, snapshot=True).SerializeToString()
    while True:
        counts: dict[tuple[str, int], int] = {}
        held: dict[int, int] = {}
        expect = -1
        try:
            for b in watch(request, metadata=meta):
                if b.gap or b.lost:
                    break
                if b.snapshot:
                    _apply_first_pages(b, counts, held, media, None)
                    if not b.snapshot_more:
                        table.reset(held)
                        expect = b.seq
                        table.set_state(READY, expect)
                    continue
                if b.seq != expect:
                    break
                _apply_first_pages(b, counts, held, media, table)
                expect = b.seq + 1
                table.set_state(READY, expect)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the server records no events
                table.set_state(NO_EVENTS)
                return
            log.info("radixd relay: events stream broke (%s): resynchronising", e.code())
        except OverflowError as e:
            log.warning("radixd relay: %s; a new snapshot in a second", e)
        table.set_state(RESYNC)
        time.sleep(1.0)


def serve(fd: int) -> None:
    """The relay process: attach the session, then serve the connections the engine hands over until it goes."""
    ctl = socket.socket(fileno=fd)
    cfg = json.loads(ctl.recv(1 << 16))
    tls = cfg["pem"].encode("latin-1") if cfg["pem"] is not None else cfg["tls"]
    try:
        client = CacheClient(cfg["target"], token=cfg["token"], tls=tls, name=cfg["name"], timeout=cfg["timeout"])
    except RadixdError as e:
        ctl.sendall(json.dumps(dict(error=str(e), code=e.code.value[0])).encode())
        return
    ctl.sendall(json.dumps(dict(session_id=client.session_id, instance_id=client.instance_id)).encode())
    channel, meta, parent = client._channel, client._meta, cfg["parent"]
    try:
        while os.getppid() == parent:
            if not select.select([ctl], [], [], 0.5)[0]:
                continue
            msg, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 2)
            if not msg:
                return  # the engine closed its end
            conn = socket.socket(fileno=fds[0])
            if msg[:1] == b"C":
                target, args = _serve_calls, (conn, channel, meta, cfg["timeout"])
            elif msg[:1] == b"F":
                conn.close()
                target, args = _follow_first_pages, (FirstPages(fds[1]), channel, meta, set(json.loads(msg[1:])))
            else:
                target, args = _serve_events, (conn, channel, meta, msg[1:])
            threading.Thread(target=target, args=args, daemon=True, name=f"relay-{msg[:1].decode()}").start()
    finally:
        client.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    try:
        serve(int(sys.argv[1]))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    os._exit(0)  # (daemon threads blocked in gRPC calls need not be waited for)
