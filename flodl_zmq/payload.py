"""The model payload: which tensors a round averages, in which order, and how to move them.

Rules this module keeps: a round averages every parameter and every
persistent floating-point buffer of the model, in that order
(`payload_tensors`); the consensus is one flat float32 vector in that order;
every process that takes part in a run builds a model with the same
`model_signature`, which the controller checks before a step is trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

from flodl_zmq.errors import ConfigError
from flodl_zmq.wire_format import WireFormat


def averaged_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a round averages, named, in the model's order: the floating-point ones that are state.

    Integer and bool buffers (BatchNorm's batch counter) have no meaningful average, and a non-persistent
    float buffer (`register_buffer(..., persistent=False)`: a causal mask of -inf, rotary frequencies) is by
    PyTorch's own rule not state but derived: both stay local, as the model factory made them (averaging
    a -inf mask gives NaN, and a bf16 wire would round rotary frequencies every round).
    """
    derived = {id(b) for m in model.modules() for name, b in m._buffers.items()
               if b is not None and name in m._non_persistent_buffers_set}
    return [(name, b) for name, b in model.named_buffers() if b.is_floating_point() and id(b) not in derived]


def named_payload(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a round averages, named, in a fixed order: every parameter, then every averaged buffer;
    each float32 and shaped, or a ConfigError naming the tensor and the fix."""
    named = list(model.named_parameters()) + averaged_buffers(model)
    for name, t in named:
        if is_lazy(t):  # before its dtype: an uninitialized parameter refuses every read
            raise ConfigError(
                f"the model holds an uninitialized parameter ({name!r}, of a LazyModule such as LazyLinear): "
                "every rank must hold every shape before the first round; have the model factory run one "
                "forward pass on a sample batch before returning the model, as DistributedDataParallel also "
                "requires"
            )
        if t.dtype != torch.float32:
            raise ConfigError(
                f"the data plane averages float32 tensors; the model's {name!r} is {t.dtype} of shape "
                f"{tuple(t.shape)}: keep the master weights in float32 (autocast for lower precision)"
            )
    if not named:
        raise ConfigError("the model has no parameters or float buffers: there is nothing to average")
    return named


def payload_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a round averages, in payload order (`named_payload`, without the names)."""
    return [t for _, t in named_payload(model)]


def check_model(model: torch.nn.Module, wire: WireFormat) -> None:
    """Refuse, before anything trains or binds, a model a round cannot average (`named_payload`), one
    whose averaged buffer holds a NaN or an infinity, and one its wire would spoil (`check_wire`).

    A non-finite buffer would be refused in every rank's first deposit, and each rank dropped as a
    poisoner: that is a constant the factory made (a float mask), which should not travel.
    """
    for name, b in averaged_buffers(model):
        if not bool(torch.isfinite(b).all()):
            raise ConfigError(
                f"the model's float buffer {name!r} holds a NaN or an infinity, and every persistent float "
                "buffer is averaged by each round, which refuses non-finite values: register a constant such as "
                "an attention mask with register_buffer(..., persistent=False) (it then stays local, as the "
                "model factory made it), or make it a bool mask")
    named_payload(model)
    check_wire(model, wire)


def check_wire(model: torch.nn.Module, wire: WireFormat) -> None:
    """Refuse the int8 wire for a model that keeps running statistics (BatchNorm's, InstanceNorm's with
    `track_running_stats`), a ConfigError naming the fix.

    An int8 block's step is its largest value / 127, and error feedback makes a value swing by up to a
    step from round to round: a channel's small running variance then loads as zero or below (on a 1-D
    CNN: NaN evals, and one final model at chance). bf16 keeps 8 significant bits and the sign of every value.
    """
    if not wire.packed:
        return
    tracked = [name for name, m in model.named_modules()
               if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats]
    if tracked:
        raise ConfigError(
            f"wire_dtype='int8' rounds each value to a step of its block's largest, and the model keeps running "
            f"statistics ({type(model.get_submodule(tracked[0])).__name__} {tracked[0] or 'model'!r}"
            f"{f' and {len(tracked) - 1} more' if len(tracked) > 1 else ''}) whose small variances would load "
            "as zero or below: use wire_dtype='bf16' (half the bytes of f32), or a norm without running "
            "statistics (GroupNorm, LayerNorm, or track_running_stats=False)")


def copy_unaveraged(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Copy into `model` the buffers of `source` (same layout) that no round averages (`averaged_buffers`):
    a copy of the consensus built fresh from the model factory then scores with the rank's own counters
    and masks (BatchNorm's `num_batches_tracked`, a running count), as the rank's live model does."""
    averaged = {id(b) for _, b in averaged_buffers(source)}
    with torch.no_grad():
        for kept, own in zip(model.buffers(), source.buffers(), strict=True):
            if id(own) not in averaged:
                kept.copy_(own)


SETTLE_POWER_ITERATIONS = 10  # from an average of unit vectors, more than the one a training step runs


def refresh_estimates(model: torch.nn.Module) -> None:
    """Re-estimate, from the weights `model` holds, the state an average does not keep: a spectral norm's
    singular vectors (`torch.nn.utils.spectral_norm` and its parametrization), by power iteration.

    An average of unit vectors is shorter than one, and in eval mode the norm is read off them as they
    stand: a consensus model scored or handed back as it was averaged divided its weights by a norm 2 to 7
    times too small. A training step runs one iteration of its own, so only a model about to be scored or
    returned needs this.
    """
    with torch.no_grad():
        for module in model.modules():
            for hook in module._forward_pre_hooks.values():
                if isinstance(hook, SpectralNorm):
                    for _ in range(SETTLE_POWER_ITERATIONS):
                        hook.compute_weight(module, do_power_iteration=True)
            for plist in getattr(module, "parametrizations", {}).values():
                for p in plist:  # torch's class for it is private; it is the one that holds these methods
                    if isinstance(p, _SpectralNorm):
                        p._power_method(p._reshape_weight_to_matrix(plist.original), SETTLE_POWER_ITERATIONS)


def parameter_count(model: torch.nn.Module) -> int:
    """How many leading values of the payload are parameters: the averaged buffers follow them."""
    return sum(p.numel() for p in model.parameters())


def model_signature(model: torch.nn.Module) -> bytes:
    """32-byte digest of the averaged tensors' names, shapes and dtypes, in payload order."""
    h = hashlib.sha256(b"flodl-model-v1")
    for name, t in named_payload(model):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.digest()


def load_flat(model: torch.nn.Module, flat: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """Copy a flat float32 vector (payload order), whole or as its consecutive chunks, into the
    model's parameters and averaged buffers."""
    chunks = [flat.reshape(-1)] if isinstance(flat, torch.Tensor) else flat
    with torch.no_grad():
        torch._foreach_copy_(*aligned_views(chunks, payload_tensors(model)))  # copy_ crosses devices itself


def flatten(model: torch.nn.Module) -> torch.Tensor:
    """The model's payload tensors as one flat float32 CPU vector (the consensus layout)."""
    return torch.cat([t.detach().reshape(-1).cpu() for t in payload_tensors(model)])


def adopt_flat(model: torch.nn.Module) -> torch.Tensor:
    """The model's payload tensors as one flat float32 CPU vector that the model's tensors then view.

    For a process that keeps both a flat consensus and the model (the controller): writing the
    consensus updates the model, and the model is held once, not twice (0.5 GB at 124M parameters).
    """
    flat = flatten(model)
    tensors = payload_tensors(model)
    if any(t.device.type != "cpu" for t in tensors):
        raise ConfigError("adopt_flat needs the model on the CPU: its tensors become views of a CPU vector")
    with torch.no_grad():
        for t, view in zip(tensors, flat_views(flat, tensors), strict=True):
            t.data = view
    return flat


def aligned_views(chunks: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> tuple[list, list]:
    """(targets, sources): views of the tensors of `like` and of `chunks` (one flat vector's consecutive
    1-D pieces, payload order), pair by pair the same elements. A tensor inside one chunk pairs whole,
    shaped; one that a chunk's end cuts pairs piece by piece (a non-contiguous one, which has no flat
    view, with its pieces gathered: one copy of that tensor)."""
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    it = iter(chunks)
    chunk, at = None, 0  # the chunk being read, and where in it
    for t in like:
        pieces, need = [], t.numel()
        while need:
            if chunk is None or at == chunk.numel():
                chunk, at = next(it), 0
            take = min(need, chunk.numel() - at)
            pieces.append(chunk[at : at + take])
            at, need = at + take, need - take
        if len(pieces) == 1:
            targets.append(t)
            sources.append(pieces[0].view(t.shape))
        elif len(pieces) > 1 and t.is_contiguous():
            targets += t.view(-1).split([p.numel() for p in pieces])
            sources += pieces
        elif pieces:
            targets.append(t)
            sources.append(torch.cat(pieces).view(t.shape))
    return targets, sources


def flat_views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into `flat`, one per tensor of `like`, shaped like it (payload order)."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape))
        offset += n
    return out
