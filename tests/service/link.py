"""A network link for tests: a TCP relay on 127.0.0.1 in front of a server, whose client-to-server direction runs at a
set rate and can be cut (reset) once a connection has sent so many bytes: a home uplink, a phone losing its signal."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

from infra.stack import free_ports


class Link:
    """Relays 127.0.0.1:`port` to 127.0.0.1:`target`. Upstream bytes go at `rate` bytes a second (None: as fast as
    they come); the first connection to carry more than `cut_after` bytes upstream, or `cut_down_after` downstream, is
    reset, both ways, once."""

    def __init__(
        self, target: int, rate: float | None = None, cut_after: int | None = None, cut_down_after: int | None = None
    ) -> None:
        self.target, self.rate, self.cut_after, self.cut_down_after = target, rate, cut_after, cut_down_after
        self.cuts = 0
        self.port = free_ports(1)[0]
        self._listener = socket.socket()
        # a small receive window, as a slow link's: loopback's (autotuned to 32 MiB) took a whole part at once
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        """Both directions on one thread, so that a cut's close is the socket's last use: closed while another thread
        waits in recv on it, a socket sends its reset only once that recv returns (the API saw none, and timed out)."""
        sent, received, started, ends = 0, 0, time.monotonic(), {client: server, server: client}
        with contextlib.suppress(OSError), client, server:
            while ends:
                ready, _, _ = select.select(list(ends), [], [])
                for source in ready:
                    data = source.recv(65536 if source is server else 16384)
                    if not data:
                        ends[source].shutdown(socket.SHUT_WR)
                        del ends[source]
                        continue
                    sent += len(data) if source is client else 0
                    received += len(data) if source is server else 0
                    if (_past(sent, self.cut_after) or _past(received, self.cut_down_after)) and self._cut_now():
                        for end in (client, server):
                            end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return  # closed by the `with`: a reset each way
                    ends[source].sendall(data)
                    if source is client and self.rate is not None:  # `sent` bytes take sent / rate seconds
                        time.sleep(max(0.0, started + sent / self.rate - time.monotonic()))

    def _cut_now(self) -> bool:
        with self._lock:
            if self.cuts:
                return False
            self.cuts += 1
            return True


def _past(count: int, limit: int | None) -> bool:
    return limit is not None and count > limit
