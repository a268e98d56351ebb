"""How much memory a worker needs for its model, and a one-line refusal when it cannot have it.

A worker holds several copies of its parameters' fp32 bytes at once (``docs/scale.md`` lists
them): on the CPU the model, its gradients, AdamW's two moments, the global params and the outer
momentum, the pseudo-gradient the transport averages, the state offered to peers and, while a
checkpoint is written, its snapshot. ``HOST_COPIES`` is the peak measured with ``diloco bench
scale`` at 85M parameters, rounded up. A worker whose estimate is more than the memory this
machine has available is refused before it builds its model (counted on PyTorch's meta device:
nothing allocated), instead of being killed by the kernel half-way through its first round.
On a GPU the model, gradients and moments sit in GPU memory (``GPU_COPIES``); the host keeps the
rest.
"""

from __future__ import annotations

import torch

from diloco.config import ConfigError
from diloco.models.gpt import ModelConfig, build_model

HOST_COPIES = 14.0  # peak resident memory over the params' fp32 bytes, a worker on the CPU
HOST_COPIES_WITH_GPU = 9.0  # the same with the model on a GPU: global params, momentum, offer, snapshot, ...
GPU_COPIES = 4.0  # model, gradients, two AdamW moments (activations come on top)


def count_parameters(model_cfg: ModelConfig, *, vocab_size: int) -> int:
    """The number of parameters of the model ``model_cfg`` describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(model_cfg, vocab_size=vocab_size)
    return sum(p.numel() for p in model.parameters())


def check_model_fits(model_cfg: ModelConfig, *, vocab_size: int, device: torch.device, workers_here: int = 1) -> None:
    """``check_fits`` for the model of ``model_cfg``: refused before anything is allocated."""
    check_fits(count_parameters(model_cfg, vocab_size=vocab_size), device=device, workers_here=workers_here)


def available_host_bytes() -> int | None:
    """What /proc/meminfo calls MemAvailable (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(param_count: int, *, device: torch.device, workers_here: int = 1) -> None:
    """Raise ``ConfigError`` (one line: the estimate and what is free) when ``workers_here`` workers
    of ``param_count`` parameters cannot fit in this machine's memory (or the GPU's)."""
    param_bytes = 4 * param_count
    on_gpu = device.type == "cuda"
    need = workers_here * param_bytes * (HOST_COPIES_WITH_GPU if on_gpu else HOST_COPIES)
    free = available_host_bytes()
    what = f"{param_count / 1e6:.1f}M parameters ({_gb(param_bytes)} in fp32)"
    workers = f"{workers_here} workers on this machine need" if workers_here > 1 else "a worker needs"
    if free is not None and need > free:
        raise ConfigError(
            f"the model has {what}: {workers} about {_gb(need)} of memory "
            f"and {_gb(free)} is available; choose a smaller model (model.*), fewer workers per machine, "
            f"or a machine with more memory"
        )
    if on_gpu:
        free_gpu, _ = torch.cuda.mem_get_info(device)
        need_gpu = workers_here * param_bytes * GPU_COPIES
        if need_gpu > free_gpu:
            raise ConfigError(
                f"the model has {what}: its weights, gradients and optimizer moments ({workers_here} "
                f"of them) need about {_gb(need_gpu)} of GPU memory and {_gb(free_gpu)} is free on {device}; "
                "choose a smaller model"
            )


def _gb(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"
