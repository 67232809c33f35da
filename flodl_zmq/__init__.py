"""flodl-zmq: distributed data-parallel training for PyTorch over ZeroMQ."""

from flodl_zmq.errors import FlodlError

__all__ = ["FlodlError"]
__version__ = "0.1.0"
