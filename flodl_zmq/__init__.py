"""flodl-zmq: distributed data-parallel training for PyTorch over ZeroMQ."""

from typing import Any

from flodl_zmq.errors import FlodlError

__all__ = ["FlodlError", "Session", "TrainResult", "Trainer", "record_scalar"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: the agent, relay and membership must start without importing torch.
    if name in ("Session", "Trainer", "TrainResult"):
        from flodl_zmq import api

        return getattr(api, name)
    if name == "record_scalar":
        from flodl_zmq import training

        return training.record_scalar
    raise AttributeError(f"module 'flodl_zmq' has no attribute {name!r}")
