"""Accelerate on flodl-zmq: an `Accelerator` that runs a stock Accelerate loop by changing one import.

    from flodl_zmq.accelerate import Accelerator     # was: from accelerate import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(E):                            # FLODL_ACCELERATE_EPOCHS=E under flodl-zmq
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), "model.pt")

Alone (no FLODL_ROLE) it is `accelerate.Accelerator`, unchanged. Under a role
(`flodl-zmq launch`, an agent, `flodl-zmq controller`) every process is a
single-process Accelerate world (one device, no torch.distributed), and
`prepare` opens a `flodl_zmq.Session` once it has the model, the optimizer
and the training loader (the first DataLoader it is given; any other, an
eval loader, is prepared as Accelerate would, whole on every process):

- controller: `prepare` runs the whole coordination, then loads the final
  consensus into the user's model; the training loader yields nothing, so
  the code after the loop (an eval, a save) sees the run's model.
- rank: pass k over the training loader yields the batches of the run's
  epoch k that ElChe dispatches to this rank (every sample once across the
  world); `optimizer.step()` reports the step with the loss of the last
  `backward`. The end of the last epoch ends the process (the Session's
  goodbye), so the code after the loop runs only on the controller.

Rules this module keeps:

- **The epochs are said outside the script** (`FLODL_ACCELERATE_EPOCHS`, a
  run setting): the controller schedules the run before any loop runs, and
  the one-line change leaves no argument to carry them.
- **No torch.distributed.** A variable Accelerate reads to form a world
  (`DISTRIBUTED_VARIABLES`) in a flodl-zmq process is refused by name: each
  process would otherwise wait for peers that never come.
- **The main process holds the run's model.** `is_main_process` is true on
  the controller (and alone), never on a rank, so `print`, `save`,
  `save_model` and `save_state` act there; on a rank they do nothing, as on
  Accelerate's other processes.
- `gather`, `gather_for_metrics`, `reduce`, `wait_for_everyone` and
  `unwrap_model` are a one-process world's: an eval loader is not split, so
  what a process gathers is already the whole set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch.utils.data import DataLoader

from flodl_zmq.errors import ConfigError
from flodl_zmq.rank import pick_device
from flodl_zmq.session import Hosted, Session, played_role

log = logging.getLogger(__name__)

# What accelerate/state.py reads to join a torch.distributed world (torchrun's, MPI's, SLURM's).
DISTRIBUTED_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def refuse_distributed(environ: Mapping[str, str]) -> None:
    """A flodl-zmq process must not let Accelerate start torch.distributed: name what would."""
    found = [name for name in DISTRIBUTED_VARIABLES if name in environ]
    if found or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        what = ", ".join(found) or "torch.distributed already initialised"
        raise ConfigError(
            f"{what}: under flodl-zmq each process is a single-process Accelerate world and flodl-zmq does "
            "the averaging; unset these variables where flodl-zmq launch / agent / controller is started "
            "(and do not start the script with torchrun or accelerate launch)"
        )


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator`, run by flodl-zmq when this process plays a role (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._role: Hosted | None = played_role()
        if self._role is not None:
            refuse_distributed(os.environ)
            if self._role.penv.local_rank is not None and torch.cuda.is_available():
                torch.cuda.set_device(pick_device(self._role.penv.local_rank))  # Accelerate's "cuda" is this one
        super().__init__(*args, **kwargs)
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._train: DataLoader | None = None
        self._session: Session | None = None
        self._stream: Iterator[Any] | None = None
        self._held: tuple[int, Any] | None = None  # a batch of a later epoch, pulled to end a pass
        self._loss: torch.Tensor | None = None

    # -- prepare -------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's prepare; under a role the training loader is the Session's, opened once all are here."""
        if self._role is None:
            return super().prepare(*args, device_placement=device_placement)
        train = next((a for a in args if isinstance(a, DataLoader)), None) if self._train is None else None
        places = device_placement or [None] * len(args)
        rest = [(a, d) for a, d in zip(args, places, strict=True) if a is not train]
        prepared = iter(self._prepare_rest([a for a, _ in rest], [d for _, d in rest]))
        for a in args:
            self._keep(a)
        result = tuple(_PassLoader(self, a) if a is train else next(prepared) for a in args)
        if train is not None:
            self._train = train
        if self._session is None and None not in (self._model, self._optimizer, self._train):
            self._open()
        return result if len(result) > 1 else result[0]

    def _prepare_rest(self, objects: list[Any], places: list[bool | None]) -> list[Any]:
        """Accelerate's prepare of everything but the training loader, always as a list."""
        if not objects:
            return []
        prepared = super().prepare(*objects, device_placement=places)
        return list(prepared) if len(objects) > 1 else [prepared]

    def _keep(self, obj: Any) -> None:
        """The model and the optimizer the Session trains: one of each."""
        for kind, attr in ((torch.nn.Module, "_model"), (torch.optim.Optimizer, "_optimizer")):
            if isinstance(obj, kind):
                if getattr(self, attr) is not None:
                    raise ConfigError(f"a second {attr[1:]} given to prepare(): a flodl-zmq run trains one model "
                                      "with one optimizer (averaged across ranks); prepare the first one only")
                setattr(self, attr, obj)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Accelerate's wrapper; under a role its `step()` also reports the step to the Session."""
        if self._role is None:
            return super().prepare_optimizer(optimizer, device_placement)
        wrapped = _ReportingOptimizer(self, optimizer, self.device_placement if device_placement is None
                                      else device_placement, self.scaler)
        self._optimizers.append(wrapped)
        return wrapped

    def _open(self) -> None:
        """Start the run: a Session over the training loader's dataset; on the controller it runs to the end."""
        epochs = self._role.penv.settings.accelerate_epochs
        if epochs is None:
            raise ConfigError("FLODL_ACCELERATE_EPOCHS is not set: under flodl-zmq the run's epochs are fixed "
                              "before the loop starts; set it to the E of the loop's `for epoch in range(E)` "
                              "where flodl-zmq launch / controller is started")
        loader = self._train
        if loader.batch_size is None:
            raise ConfigError("the training DataLoader has batch_size=None (a batch_sampler of its own): "
                              "flodl-zmq batches the dataset itself; give the DataLoader a batch_size")
        session = Session(self._model, self._optimizer, loader.dataset, batch_size=loader.batch_size,
                          epochs=epochs, collate_fn=loader.collate_fn)
        session.__enter__()  # left when the last epoch's batches are done (`_next`), or here on the controller
        self._session = session
        if session.result is not None:  # the controller: its run is over, and its role free again
            session.__exit__(None, None, None)
            self._model.load_state_dict(session.result.model.state_dict())
            return
        self._stream = session.batches()

    # -- the loop --------------------------------------------------------------

    def _pass(self, epoch: int) -> Iterator[Any]:
        """The batches of `epoch` dispatched to this process; none on the controller."""
        while self._stream is not None:
            if self._held is None:
                batch = next(self._stream, _END)
                if batch is _END:
                    self._stream = None
                    self._session.__exit__(None, None, None)  # a rank says goodbye and ends here
                    return
                self._held = (self._session.epoch, batch)
            held_epoch, batch = self._held
            if held_epoch != epoch:
                return  # the next pass's first batch stays held
            self._held = None
            yield batch

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's backward; the loss is reported with the optimizer's step."""
        self._loss = loss.detach()
        super().backward(loss, **kwargs)

    def _stepped(self) -> None:
        if self._session is not None and self._session.result is None:
            self._session.step(self._loss)
            self._loss = None

    # -- where the run's model is ----------------------------------------------

    @property
    def is_main_process(self) -> bool:
        return super().is_main_process if self._role is None else self._role.penv.role == "controller"

    @property
    def is_local_main_process(self) -> bool:
        return self.is_main_process

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        if self.is_main_process:
            super().save(obj, f, safe_serialization=safe_serialization)

    def save_model(self, model: torch.nn.Module, save_directory: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            super().save_model(model, save_directory, **kwargs)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        if self.is_main_process:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        return None


_END = object()


class _PassLoader:
    """The training loader under a role: pass k over it is the run's epoch k on this process."""

    def __init__(self, accelerator: Accelerator, loader: DataLoader) -> None:
        self._accelerator = accelerator
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self._length = len(loader)
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        self._passes += 1
        return self._accelerator._pass(self._passes - 1)

    def __len__(self) -> int:
        # ElChe sizes each rank's share as it goes; the whole epoch's batches is the bound a schedule can use.
        return self._length


class _ReportingOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose step is also the Session's step of the batch in hand."""

    def __init__(self, accelerator: Accelerator, optimizer: torch.optim.Optimizer, device_placement: bool,
                 scaler: Any) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self._accelerator = accelerator

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        self._accelerator._stepped()


__all__ = ["DISTRIBUTED_VARIABLES", "Accelerator", "refuse_distributed"]
