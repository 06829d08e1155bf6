"""A fault-injecting TCP proxy on 127.0.0.1 in front of an HTTP storage emulator.

    with FaultProxy(upstream_port) as proxy:     # point the client at proxy.endpoint
        proxy.fail_next(3)                       # the next 3 requests are answered 503
        proxy.cut_after(5 << 20)                 # the server "stops" after 5 MiB more uploaded
        proxy.cut_after(5 << 20, restore_after=0.5)   # ... for half a second
        proxy.stall_after(0)                     # uploads hang (connections held open, nothing sent on)
        proxy.stalled.wait()                     # ... until a request is held that way
        proxy.break_downloads(1, after=1 << 20)  # the next answer breaks off after 1 MiB
        proxy.restore()                          # ... and comes back

It understands just enough HTTP/1.1 (request heads and Content-Length bodies on the
client-to-server side) to count requests; responses are piped through untouched unless
`break_downloads` cuts one off. HTTP
clients do not pipeline, so a request head arriving means the previous response is complete
and a 503 can be answered in its place. Every fault is bounded: a burst is a count, an outage
lasts until `restore()`.
"""

from __future__ import annotations

import socket
import threading

_CRLF2 = b"\r\n\r\n"


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._fail = 0
        self._fail_status = 503
        self._cut_budget: int | None = None
        self._restore_after: float | None = None
        self._down = False
        self._stall_budget: int | None = None
        self._breaks = 0
        self._break_after = 0
        self._break_budget = 0
        self._flowing = threading.Event()
        self._flowing.set()
        self.stalled = threading.Event()  # set once stall_after() holds a request
        self._conns: set[socket.socket] = set()
        self.requests = 0
        self.injected = 0
        self.refused = 0
        self.outages = 0
        self.broken = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._thread.start()

    # -- control ------------------------------------------------------------------------------
    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next `count` requests with `status` (and close those connections)."""
        with self._lock:
            self._fail, self._fail_status = count, status

    def cut_after(self, nbytes: int, *, restore_after: float | None = None) -> None:
        """After `nbytes` more bytes from clients, drop every connection and refuse new ones
        (until `restore()`, or for `restore_after` seconds from the moment it goes down)."""
        with self._lock:
            self._cut_budget = nbytes
            self._restore_after = restore_after
        if nbytes <= 0:
            self._go_down()

    def stall_after(self, nbytes: int) -> None:
        """After `nbytes` more bytes from clients, stop forwarding client bytes (connections stay
        open, so a client blocks mid-request as on a hung network) until `restore()`."""
        with self._lock:
            self._stall_budget = nbytes
            self.stalled.clear()
            self._flowing.clear()

    def break_downloads(self, count: int, *, after: int) -> None:
        """The next `count` times `after` bytes have come back from the server (since the last
        break), drop that connection there: an answer whose body breaks off mid-way."""
        with self._lock:
            self._breaks, self._break_after, self._break_budget = count, after, after

    def restore(self) -> None:
        with self._lock:
            self._breaks = 0
            self._down = False
            self._cut_budget = None
            self._restore_after = None
            self._fail = 0
            self._stall_budget = None
            self._flowing.set()

    def close(self) -> None:
        """Stop listening (the port refuses connections from here on) and drop every connection."""
        self._closed = True
        self._go_down()
        self._flowing.set()  # a stalled request ends (the proxy is down)
        try:  # wakes the accept loop: while it waits in accept(), close() alone leaves the port listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        self._thread.join(5)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- machinery ----------------------------------------------------------------------------
    def _go_down(self) -> None:
        with self._lock:
            if not self._down:
                self.outages += 1
                if self._restore_after is not None:
                    timer = threading.Timer(self._restore_after, self.restore)
                    timer.daemon = True
                    timer.start()
            self._down = True
            conns = list(self._conns)
            self._conns.clear()
        for conn in conns:
            _kill(conn)

    def _count_upload(self, n: int) -> bool:
        """Account `n` client bytes; False when the cut point was reached."""
        with self._lock:
            if self._down:
                return False
            stall = False
            if self._stall_budget is not None:
                self._stall_budget -= n
                stall = self._stall_budget <= 0
            cut = self._cut_budget is not None and self._cut_budget - n <= 0
            if self._cut_budget is not None:
                self._cut_budget -= n
        if stall:
            self.stalled.set()
            self._flowing.wait()
            with self._lock:
                if self._down:
                    return False
        if cut:
            self._go_down()
            return False
        return True

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                self.refused += 1
                _kill(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        with self._lock:
            self._conns.add(client)
        try:
            buf = b""
            while True:
                while _CRLF2 not in buf:
                    data = client.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(_CRLF2)
                length, chunked = _body_framing(head)
                with self._lock:
                    self.requests += 1
                    inject = self._fail > 0
                    if inject:
                        self._fail -= 1
                        self.injected += 1
                        status = self._fail_status
                if inject:
                    body = f"injected fault: HTTP {status}".encode()
                    client.sendall(
                        f"HTTP/1.1 {status} Injected Fault\r\nContent-Type: text/plain\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                        + body
                    )
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=None)
                    with self._lock:
                        self._conns.add(upstream)
                    threading.Thread(target=self._pipe_down, args=(upstream, client), daemon=True).start()
                if not self._count_upload(len(head) + 4):
                    return
                upstream.sendall(head + _CRLF2)
                if chunked:  # cannot frame it: pipe the rest of this connection untouched
                    if buf:
                        upstream.sendall(buf)
                    while True:
                        data = client.recv(65536)
                        if not data or not self._count_upload(len(data)):
                            return
                        upstream.sendall(data)
                remaining = length
                while remaining > 0:
                    if not buf:
                        buf = client.recv(min(65536, remaining))
                        if not buf:
                            return
                    piece, buf = buf[:remaining], buf[remaining:]
                    if not self._count_upload(len(piece)):
                        return
                    upstream.sendall(piece)
                    remaining -= len(piece)
        except OSError:
            return
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._conns.discard(sock)
                    _kill(sock)

    def _download_budget(self, n: int) -> int | None:
        """Of `n` bytes from the server, how many to pass before breaking the connection (None:
        all of them, no break due)."""
        with self._lock:
            if self._breaks <= 0:
                return None
            if n < self._break_budget:
                self._break_budget -= n
                return None
            keep = self._break_budget
            self._breaks -= 1
            self.broken += 1
            self._break_budget = self._break_after
            return keep

    def _pipe_down(self, src: socket.socket, dst: socket.socket) -> None:
        """Pipe the server's answers to the client, breaking off where `break_downloads` says;
        either side closing closes both."""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                keep = self._download_budget(len(data))
                if keep is not None:
                    dst.sendall(data[:keep])
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _kill(dst)
            _kill(src)


def _body_framing(head: bytes) -> tuple[int, bool]:
    length, chunked = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip() or 0)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return length, chunked


def _kill(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


__all__ = ["FaultProxy"]
