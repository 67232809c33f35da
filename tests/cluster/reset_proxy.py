"""A TCP proxy of the tests' own in front of the controller's four ports, which closes its connections.

It never alters a byte; `reset()` closes every connection it carries, both
sides, and ZeroMQ re-dials underneath. Used in process by
tests/cluster/test_reconnect.py, and inside a network namespace as a script
by tests/cluster/test_chaos.py:

    python -m tests.cluster.reset_proxy LISTEN_HOST:PORT TARGET_HOST:PORT

which resets once (at once, whatever is in flight) for each line it reads
on stdin, printing `reset N` after each, and forwards until stdin closes.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

from flodl_zmq.endpoints import OFFSETS

QUIET_S = 0.05  # a connection is closed only after this long without a byte either way
QUIET_WAIT_S = 5.0
SWALLOW_S = 0.2  # a busy reset first swallows what crosses each connection this long, then closes it


class ResettingProxy:
    """Forwards listen_host:listen+i to target_host:target+i for the controller's ports; `reset()` closes every connection.

    With `quiet_s`, each connection is closed at a moment it is quiet (no
    byte either way for that long): a reset then loses no record in flight.
    With 0, at once, whatever it carries. A busy reset is a middlebox that
    dies: every connection swallows what crosses it for `SWALLOW_S`, then
    closes, so every record sent meanwhile, either way, is lost and must be
    recovered: by request on the data links, by resend on the control link.
    It never alters a byte it forwards.
    """

    def __init__(self, listen: int, target: int, listen_host: str = "127.0.0.1", target_host: str = "127.0.0.1",
                 quiet_s: float = QUIET_S):
        self.listen, self.target = listen, target
        self.listen_host, self.target_host, self.quiet_s = listen_host, target_host, quiet_s
        self._lock = threading.Lock()
        self._pairs: list[tuple[int, socket.socket, socket.socket, list[float | bool]]] = []
        self._servers: list[socket.socket] = []
        self._stop = threading.Event()
        self.resets = 0
        self.accepted = 0

    def start(self) -> None:
        for offset in range(max(OFFSETS.values()) + 1):
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((self.listen_host, self.listen + offset))
            srv.listen(64)
            srv.settimeout(0.2)
            self._servers.append(srv)
            threading.Thread(target=self._accept, args=(srv, offset), daemon=True).start()

    def _accept(self, srv: socket.socket, offset: int) -> None:
        while not self._stop.is_set():
            try:
                client, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection((self.target_host, self.target + offset), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            last = [time.monotonic(), False]  # when a byte last crossed, either way; swallowing
            with self._lock:
                self._pairs.append((offset, client, upstream, last))
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, last), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, last: list[float | bool]) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                last[0] = time.monotonic()
                if last[1]:
                    continue  # swallowed: the busy reset's dead middlebox
                dst.sendall(data)
                last[0] = time.monotonic()
        except OSError:
            pass
        for s in (src, dst):
            self._close(s)

    def _close(self, s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def reset(self, busy: bool = False) -> float:
        """Close every connection (both sides), each when quiet, or (`busy`) after swallowing what crosses it.

        Returns the longest wait for a quiet moment.
        """
        with self._lock:
            closing, self._pairs = self._pairs, []
        if busy:
            for _, _, _, last in closing:
                last[1] = True
            time.sleep(SWALLOW_S)
        longest = 0.0
        for _, a, b, last in closing:
            t0 = time.monotonic()
            if not busy:
                while time.monotonic() - last[0] < self.quiet_s and time.monotonic() - t0 < QUIET_WAIT_S:
                    time.sleep(self.quiet_s / 10)
                longest = max(longest, time.monotonic() - t0)
            self._close(a)
            self._close(b)
        self.resets += 1
        return longest

    def stop(self) -> None:
        self._stop.set()
        for s in self._servers:
            s.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for _, a, b, _ in pairs:
            self._close(a)
            self._close(b)


def main(argv: list[str]) -> None:
    (listen_host, listen), (target_host, target) = (
        (a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in argv[:2]
    )
    proxy = ResettingProxy(listen, target, listen_host, target_host, quiet_s=0.0)
    proxy.start()
    print("proxy up", flush=True)
    for n, _ in enumerate(sys.stdin, start=1):
        proxy.reset()
        print(f"reset {n}, {proxy.accepted} connections so far", flush=True)
    proxy.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
