"""How much memory a worker needs for its model, and a one-line refusal when it cannot have it.

A worker holds several copies of its parameters' fp32 bytes at once (``docs/scale.md`` lists
them): on the CPU the model, its gradients, AdamW's two moments, the global params and the outer
momentum, the pseudo-gradient the transport averages, the state offered to peers and, while a
checkpoint is written, its snapshot. ``HOST_COPIES`` is the peak measured with ``diloco bench
scale`` at 85M parameters, rounded up. A worker whose estimate is more than the memory this
machine has available is refused before it builds its model (counted on PyTorch's meta device:
nothing allocated), instead of being killed by the kernel half-way through its first round.
On a GPU the model, gradients and moments sit in GPU memory (``GPU_COPIES``, two more with
``outer.global_device=model``), and so do the inner step's activations: for the built-in GPT about
``ACTIVATION_BYTES_PER_LAYER_WIDTH`` x layers x width + ``ACTIVATION_BYTES_PER_VOCAB`` x vocabulary
bytes a token of the batch (the logits and their fp32 loss), fitted to the peaks ``diloco bench gpu``
measured at 111M parameters on an H200 (10.4 GB compiled, 14.5 GB eager at batch 16 x 1024; 36.7
GB compiled at batch 64). Several workers sharing one GPU (``diloco local`` on a GPU machine) each
count their own.
"""

from __future__ import annotations

import torch

from diloco.config import ConfigError
from diloco.models.gpt import ModelConfig, build_model

HOST_COPIES = 14.0  # peak resident memory over the params' fp32 bytes, a worker on the CPU
HOST_COPIES_WITH_GPU = 9.0  # the same with the model on a GPU: global params, momentum, offer, snapshot, ...
GPU_COPIES = 4.0  # model, gradients, two AdamW moments (activations come on top)
ACTIVATION_BYTES_PER_LAYER_WIDTH = 40  # a token's saved activations, per block and unit of width
ACTIVATION_BYTES_PER_VOCAB = 8  # a token's logits (bf16) and their loss's fp32 share


def count_parameters(model_cfg: ModelConfig, *, vocab_size: int) -> int:
    """The number of parameters of the model ``model_cfg`` describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(model_cfg, vocab_size=vocab_size)
    return sum(p.numel() for p in model.parameters())


def check_model_fits(
    model_cfg: ModelConfig,
    *,
    vocab_size: int,
    device: torch.device,
    workers_here: int = 1,
    batch_size: int = 0,
    global_on_gpu: bool = False,
) -> None:
    """``check_fits`` for the model of ``model_cfg`` at ``batch_size`` sequences a step: refused
    before anything is allocated."""
    check_fits(
        count_parameters(model_cfg, vocab_size=vocab_size),
        device=device,
        workers_here=workers_here,
        activation_bytes=activation_bytes(model_cfg, vocab_size=vocab_size, batch_size=batch_size),
        gpu_copies=GPU_COPIES + (2 if global_on_gpu else 0),
    )


def activation_bytes(model_cfg: ModelConfig, *, vocab_size: int, batch_size: int) -> int:
    """The inner step's activations on a GPU, estimated for the built-in GPT (0 for other models)."""
    if model_cfg.kind != "gpt":
        return 0
    per_token = ACTIVATION_BYTES_PER_LAYER_WIDTH * model_cfg.n_layer * model_cfg.n_embd
    per_token += ACTIVATION_BYTES_PER_VOCAB * vocab_size
    return batch_size * model_cfg.block_size * per_token


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


def check_fits(
    param_count: int,
    *,
    device: torch.device,
    workers_here: int = 1,
    activation_bytes: int = 0,
    gpu_copies: float = GPU_COPIES,
) -> None:
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
        need_gpu = workers_here * (param_bytes * gpu_copies + activation_bytes)
        if need_gpu > free_gpu:
            sharing = f"{workers_here} workers sharing {device}" if workers_here > 1 else "a worker"
            raise ConfigError(
                f"the model has {what}: {sharing} need about {_gb(need_gpu)} of GPU memory (weights, "
                f"gradients, optimizer moments and the activations of a step: {_gb(activation_bytes)} each) "
                f"and {_gb(free_gpu)} is free on {device}; lower inner.batch_size, run fewer workers on "
                "this GPU, or choose a smaller model"
            )


def _gb(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"
