"""A hostile ZMTP 3.0 peer written on a plain TCP socket: it sends what no libzmq would.

ZeroMQ's own sockets buffer what they send, so an attacker built from one would
grow the test process as much as the victim; this one writes bytes straight to
the kernel and keeps nothing.
"""

from __future__ import annotations

import socket
import struct

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _ready(socket_type: bytes, identity: bytes) -> bytes:
    body = b"\x05READY" + _prop(b"Socket-Type", socket_type) + _prop(b"Identity", identity)
    return bytes([0x04, len(body)]) + body


def frame_header(size: int, more: bool) -> bytes:
    """The header of one message frame of `size` bytes (ZMTP 3.0, 2.3.5)."""
    flags = 0x01 if more else 0x00
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | 0x02]) + struct.pack(">Q", size)


class RawPeer:
    """A DEALER as far as the other end can tell, connected over NULL security."""

    def __init__(self, endpoint: str, identity: bytes = b"", timeout_s: float = 10.0):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.sendall(GREETING + _ready(b"DEALER", identity))

    def send_raw(self, data: bytes | memoryview) -> bool:
        """Write `data`; False once the other end has closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return False

    def send_big_frame(self, size: int, chunk: int = 1 << 20) -> int:
        """Send one frame of `size` zero bytes; the bytes written before the peer hung up."""
        if not self.send_raw(frame_header(size, more=False)):
            return 0
        block, sent = memoryview(bytes(chunk)), 0
        while sent < size:
            n = min(chunk, size - sent)
            if not self.send_raw(block[:n]):
                return sent
            sent += n
        return sent

    def send_empty_frames(self, count: int, batch: int = 1 << 16) -> bool:
        """Send one message of `count` empty frames (2 bytes each on the wire)."""
        more = frame_header(0, more=True) * batch
        left = count - 1
        while left > 0:
            n = min(batch, left)
            if not self.send_raw(more[: 2 * n]):
                return False
            left -= n
        return self.send_raw(frame_header(0, more=False))

    def close(self) -> None:
        self.sock.close()
