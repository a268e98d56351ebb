"""How much memory a worker needs for its model, and a one-line refusal when it cannot have it.

A worker holds several copies of its parameters' fp32 bytes at once (``docs/scale.md`` lists
them): on the CPU the model, its gradients, AdamW's two moments, the global params and the outer
momentum, and hivemind's averager buffer, in which the pseudo-gradient is formed and averaged;
its averager process holds parts in flight. Checkpoints are written from the live tensors and add
nothing. ``HOST_COPIES`` is the peak of the summed PSS of a run's whole process tree, less a tiny
model's run, per worker, measured with ``diloco bench scale`` at 85M parameters, rounded up. A
worker whose estimate is more than the memory this machine has available is refused before it
builds its model (counted on PyTorch's meta device:
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

from diloco.config import Config, ConfigError
from diloco.data.corpus import load_corpus
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model

HOST_COPIES = 9.0  # a worker's share of its run's peak PSS over the params' fp32 bytes, on the CPU (8.6 measured)
# the same with the model on a GPU: global params, momentum, the averager's buffer and its parts in flight
HOST_COPIES_WITH_GPU = 5.0
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
    precision: str = "bf16",
    global_on_gpu: bool = False,
    stepping_at_once: int | None = None,
    gpu_share: float = 0.0,
) -> None:
    """``check_fits`` for the model of ``model_cfg`` at ``batch_size`` sequences a step: refused
    before anything is allocated. ``stepping_at_once``: the workers whose activations coexist
    (simulated workers take turns: 1; default all); ``gpu_share``: the fraction of the GPU each
    worker may take (``worker.gpu_memory_fraction``; 0 = all that is free)."""
    check_fits(
        count_parameters(model_cfg, vocab_size=vocab_size),
        device=device,
        workers_here=workers_here,
        activation_bytes=activation_bytes(model_cfg, vocab_size=vocab_size, batch_size=batch_size, precision=precision),
        gpu_copies=GPU_COPIES + (2 if global_on_gpu else 0),
        stepping_at_once=workers_here if stepping_at_once is None else stepping_at_once,
        gpu_share=gpu_share,
    )


def activation_bytes(model_cfg: ModelConfig, *, vocab_size: int, batch_size: int, precision: str = "bf16") -> int:
    """The inner step's activations on a GPU, estimated for the built-in GPT (0 for other models);
    fp32 activations take twice bf16's."""
    if model_cfg.kind != "gpt":
        return 0
    per_token = ACTIVATION_BYTES_PER_LAYER_WIDTH * model_cfg.n_layer * model_cfg.n_embd
    per_token += ACTIVATION_BYTES_PER_VOCAB * vocab_size
    return batch_size * model_cfg.block_size * per_token * (2 if precision == "fp32" else 1)


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
    stepping_at_once: int = 1,
    gpu_share: float = 0.0,
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
        need_gpu = workers_here * param_bytes * gpu_copies + stepping_at_once * activation_bytes
        _check_gpu(need_gpu, what=what, device=device, workers_here=workers_here, gpu_share=gpu_share)


def _check_gpu(need: float, *, what: str, device: torch.device, workers_here: int, gpu_share: float) -> None:
    """The GPU's side of ``check_fits``: ``need`` bytes against what is free (or this worker's share)."""
    free, total = torch.cuda.mem_get_info(device)
    if gpu_share:
        free = min(free, gpu_share * total)
    if need <= free:
        return
    sharing = f"{workers_here} workers sharing {device} need" if workers_here > 1 else "a worker needs"
    raise ConfigError(
        f"the model has {what}: {sharing} about {_gb(need)} of GPU memory (weights, gradients, optimizer "
        f"moments, a step's activations) and {_gb(free)} is {'its share' if gpu_share else 'free'} on {device}; "
        "lower inner.batch_size, run fewer workers on this GPU, or choose a smaller model"
    )


def _gb(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"


def check_local_run_fits(cfg: Config, *, workers: int) -> None:
    """``diloco local`` / ``testbed``: refuse, before any worker starts, ``workers`` workers of
    ``cfg`` that cannot fit this machine together (on its GPU when they would train there; the
    corpus is read for its vocabulary)."""
    corpus = load_corpus(cfg.data)
    on_gpu = cfg.worker.device != "cpu" and torch.cuda.is_available()  # the workers all on one machine
    check_model_fits(
        cfg.model,
        vocab_size=corpus.vocab_size,
        device=torch.device("cuda" if on_gpu else "cpu"),
        workers_here=workers,
        batch_size=cfg.inner.batch_size,
        precision=cfg.worker.precision,
        global_on_gpu=cfg.outer.global_device == "model",
        stepping_at_once=1 if cfg.comm.backend == "simulator" else workers,  # simulated: they take turns
    )


def out_of_gpu_memory() -> str:
    """The one line for a worker whose GPU ran out of memory (its checkpoints stay on disk)."""
    reached = ""
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        used = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        reached = f" (cuda:{device}: this process reached {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)"
    return (
        f"the GPU ran out of memory{reached}: lower inner.batch_size, run fewer workers on this GPU "
        "(worker.gpu_memory_fraction is each one's share), or choose a smaller model; rerunning the same "
        "command resumes from the last checkpoint, if the run wrote one"
    )
