"""``diloco bench gpu``: what one NVIDIA GPU gives the inner step, and what the outer sync costs it.

In under 5 minutes on one GPU it measures, with the project's own code (``inner_step``,
``build_inner_optimizer``, ``OuterStep``):

- **inner-step throughput** (tokens/s) and **MFU** of the built-in GPT at 12 layers x width 768,
  12 heads, context 1024, a 32,768-token vocabulary (about 110M params: the 32k vocabulary makes
  it smaller than GPT-2's 124M), batch 16, bf16 autocast, fused AdamW; eager, then compiled in
  place (``torch.compile``; its failure is reported, not fatal);
- the **outer sync's local work** (pseudo-gradient and its copies, the Nesterov outer step, the
  copy back into the model: ``OuterStep.sync`` over a loopback transport that averages with
  nobody, so no codec and no network) and the digest of the global params that every round's
  record carries (core/digest.py) for each ``outer.global_device``, as a share of a round of
  H=100 inner steps: local work / (H x step time + local work);
- **peak GPU memory** of the inner steps;
- **the levers on MFU**, each an arm of its own (``LEVERS``; ``--levers`` picks them): the
  batch (32, 64: the latter is a 4-worker run's global batch on one GPU), the attention kernel
  (cuDNN's instead of the default flash kernel), compile's autotuning mode. The built-in GPT's
  32,768-token vocabulary is already a multiple of 128: there is nothing to pad.

MFU = flops_per_token x tokens/s / the GPU's peak dense bf16 FLOP/s (``PEAK_BF16_TFLOPS`` by
device name, or ``--peak-tflops``), with flops_per_token = 6 N + 12 L T d: N the params without
the position embedding (a lookup, no matmul), plus attention's scores and mixing, forward and
backward, over the full T x T (nanoGPT's and PaLM's convention; causal masking halves the work
actually needed). Figures are medians of repeats, warm-up steps excluded. Targets: MFU >= 45%,
outer local work < 1% of a round.

    diloco bench gpu                   # exits 2 when no CUDA device is visible
    diloco bench gpu --smoke           # tiny sizes, on the CPU too: checks the code path (CI)
    python -m diloco.bench.gpu ...     # the same with only torch installed (no omegaconf, no hivemind)
    bash launch/gpu_check.sh           # set up, then the measurement

Human-readable lines first, then one JSON line, also written to ``OUT/gpu.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from diloco.bench import write_json
from diloco.comm.base import Averaging, Outcome, SyncResult
from diloco.core.digest import tensors_digest
from diloco.core.host_copies import GLOBAL_DEVICES
from diloco.core.inner import InnerConfig, build_inner_optimizer, inner_step
from diloco.core.outer import OuterConfig, OuterStep
from diloco.errors import UsageError
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model

# peak dense (no sparsity) bf16 tensor-core TFLOP/s from the vendors' data sheets; the first
# name that occurs in torch.cuda.get_device_name() wins, so the specific ones come first
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
TARGET_MFU = 0.45
TARGET_OUTER_FRACTION = 0.01


@dataclass(frozen=True)
class BenchSize:
    """The model and the repeats measured."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    context: int = 1024
    vocab: int = 32_768
    batch: int = 16  # sequences per inner step
    warmup_steps: int = 5  # untimed steps before each arm (the compiled arm compiles in them)
    steps: int = 20  # timed inner steps per repeat
    repeats: int = 3
    outer_repeats: int = 5  # timed outer syncs per global device, after one untimed
    sync_every: int = 100  # H, for the outer sync's share of a round


@dataclass(frozen=True)
class Lever:
    """One way of running the inner step: eager or compiled (in which mode), at which batch, with
    which attention kernel. ``batch`` 0 is the size's own."""

    name: str
    compile_mode: str | None = "default"  # None: eager; else torch.compile's mode
    batch: int = 0
    attention: str = "default"  # default: PyTorch's choice / cudnn: cuDNN's fused attention


# the arms measured by default, in order; the first two are the figures of earlier versions
LEVERS = {
    lever.name: lever
    for lever in (
        Lever("eager", compile_mode=None),
        Lever("compiled"),
        Lever("compiled-cudnn-attention", attention="cudnn"),
        Lever("compiled-batch32", batch=32),
        Lever("compiled-batch64", batch=64),
        Lever("compiled-batch64-cudnn-attention", batch=64, attention="cudnn"),
        Lever("compiled-max-autotune", compile_mode="max-autotune-no-cudagraphs"),
        Lever("compiled-batch64-max-autotune", batch=64, compile_mode="max-autotune-no-cudagraphs"),
    )
}
DEFAULT_LEVERS = ("eager", "compiled", "compiled-batch64", "compiled-batch64-cudnn-attention")
SMOKE_LEVERS = ("eager", "compiled")  # on a GPU; the CPU's smoke run measures the eager arm alone


# a code-path check that runs in seconds on a CPU (the tests' and CI's)
SMOKE = BenchSize(
    layers=2, width=64, heads=2, context=64, vocab=512, batch=2, warmup_steps=1, steps=2, repeats=2, outer_repeats=2
)


class NoCudaDevice(RuntimeError):
    """The measurement needs a GPU and none is visible; one line."""


class Loopback(Averaging):
    """The averaging of a run with one worker: the mean of its own pseudo-gradient is itself."""

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        return SyncResult(Outcome.AVERAGED, peers=1, total_weight=weight)


def peak_tflops_for(device_name: str) -> float | None:
    """Peak dense bf16 TFLOP/s of a GPU from its name; None when it is not in the table."""
    return next((tflops for name, tflops in PEAK_BF16_TFLOPS if name in device_name), None)


def flops_per_token(model: torch.nn.Module, size: BenchSize) -> int:
    """6 N (N without the position embedding) + 12 L T d for attention: forward and backward."""
    matmul_params = sum(p.numel() for p in model.parameters()) - size.context * size.width
    return 6 * matmul_params + 12 * size.layers * size.context * size.width


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attention(kind: str):
    """The context that picks the attention kernel of ``scaled_dot_product_attention``."""
    if kind == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION}[kind]])


def _inner_step_s(model, optimizer, batch, size: BenchSize, device: torch.device, attention: str) -> float:
    """Median seconds per inner step over ``size.repeats`` repeats, after ``size.warmup_steps``."""

    def step() -> None:
        with _attention(attention):
            inner_step(model, optimizer, batch, lr=1e-4, grad_clip=1.0, precision="bf16")

    for _ in range(size.warmup_steps):
        step()
    _synchronize(device)
    per_step = []
    for _ in range(size.repeats):
        started = time.perf_counter()
        for _ in range(size.steps):
            step()
        _synchronize(device)  # the host runs ahead of the GPU: time to the end of its work
        per_step.append((time.perf_counter() - started) / size.steps)
    return statistics.median(per_step)


def _build(size: BenchSize, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model_cfg = ModelConfig(n_layer=size.layers, n_head=size.heads, n_embd=size.width, block_size=size.context)
    return build_model(model_cfg, vocab_size=size.vocab).to(device)


def measure_lever(lever: Lever, size: BenchSize, device: torch.device, flops: int, peak_tflops: float | None) -> dict:
    """One arm on a fresh model and optimizer: its step time, tokens/s, MFU and peak GPU memory.
    A failure (a compiler or kernel missing on this machine) is the arm's ``error``, not fatal."""
    size = replace(size, batch=lever.batch or size.batch)
    torch._dynamo.reset()  # each arm compiles afresh (the on-disk caches stay)
    gc.collect()  # the last arm's model and graphs, before this arm's peak is counted
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        model = _build(size, device)
        optimizer = build_inner_optimizer(InnerConfig(), model)
        if lever.compile_mode is not None:
            model.compile(mode=None if lever.compile_mode == "default" else lever.compile_mode)  # in place
        tokens = torch.randint(0, size.vocab, (size.batch, size.context + 1), device=device)
        step_s = _inner_step_s(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), size, device, lever.attention)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}", "batch": size.batch}
    figures = {"batch": size.batch, **_arm(step_s, size, flops, peak_tflops)}
    figures["wall_s"] = time.perf_counter() - started
    if device.type == "cuda":
        figures["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return figures


def _outer_sync_s(model: torch.nn.Module, global_device: str, size: BenchSize, device: torch.device) -> dict:
    """Median seconds of one ``OuterStep.sync`` over the loopback transport, copies back included,
    and of the digest of the global params that every round takes after it (its record's
    ``param_sha256``; the fingerprint of a round that not every worker averaged in)."""
    outer = OuterStep(list(model.parameters()), OuterConfig(global_device=global_device))
    backend = Loopback()
    timings = []
    for round_index in range(size.outer_repeats + 1):  # the first allocates buffers and momentum: untimed
        _synchronize(device)
        started = time.perf_counter()
        outer.sync(backend, weight=1.0, round_index=round_index, deadline_s=60.0)
        _synchronize(device)
        timings.append(time.perf_counter() - started)
    digests = []
    for _ in range(size.outer_repeats):
        started = time.perf_counter()
        tensors_digest(outer.global_params)
        digests.append(time.perf_counter() - started)
    del outer
    return {"sync_s": statistics.median(timings[1:]), "digest_s": statistics.median(digests)}


def _arm(step_s: float, size: BenchSize, flops: int, peak_tflops: float | None) -> dict:
    tokens_per_s = size.batch * size.context / step_s
    mfu = flops * tokens_per_s / (peak_tflops * 1e12) if peak_tflops else None
    return {"step_s": step_s, "tokens_per_s": tokens_per_s, "mfu": mfu}


def _print_lever(name: str, figures: dict, size: BenchSize) -> None:
    if "error" in figures:
        print(f"inner step ({name}): failed: {figures['error']}")
        return
    mfu = f"MFU {figures['mfu']:.1%}" if figures["mfu"] is not None else "MFU ? (no peak for this device)"
    memory = f", peak {figures['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in figures else ""
    print(
        f"inner step ({name}, batch {figures['batch']}): {figures['tokens_per_s']:,.0f} tok/s, "
        f"{figures['step_s'] * 1e3:.1f} ms/step, {mfu}{memory} (target >= {TARGET_MFU:.0%}; "
        f"median of {size.repeats} x {size.steps} steps; {figures['wall_s']:.0f} s with compiling)"
    )


def _outer_figures(size: BenchSize, device: torch.device, step_s: float) -> dict:
    """The outer sync's local work and the digest, per global device, as a share of a round of
    ``size.sync_every`` steps of ``step_s``."""
    model, outer = _build(size, device), {}
    for global_device in GLOBAL_DEVICES:
        figures = _outer_sync_s(model, global_device, size, device)
        local_s = figures["sync_s"] + figures["digest_s"]
        figures["round_fraction"] = local_s / (size.sync_every * step_s + local_s)
        outer[global_device] = figures
        print(
            f"outer sync, local work, outer.global_device={global_device}: {figures['sync_s'] * 1e3:.1f} ms "
            f"+ {figures['digest_s'] * 1e3:.1f} ms for the params' digest = "
            f"{figures['round_fraction']:.2%} of a round of H={size.sync_every} (target < {TARGET_OUTER_FRACTION:.0%})"
        )
    return outer


def run_gpu_benchmark(
    *,
    size: BenchSize,
    out: Path,
    allow_cpu: bool = False,
    peak_tflops: float | None = None,
    levers: Sequence[str] = DEFAULT_LEVERS,
) -> int:
    """Measure, print the figures and one JSON line, write it to ``out/gpu.json``. Raises
    ``NoCudaDevice`` when no GPU is visible and ``allow_cpu`` is not set."""
    started = time.perf_counter()
    if not torch.cuda.is_available() and not allow_cpu:
        raise NoCudaDevice(
            "no CUDA device is visible: diloco bench gpu measures a GPU (--smoke or --allow-cpu run it on the CPU)"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_source = "--peak-tflops" if peak_tflops else None
    if peak_tflops is None and device.type == "cuda":
        peak_tflops = peak_tflops_for(device_name)
        peak_source = "table" if peak_tflops else None
    model = _build(size, device)
    params, flops = sum(p.numel() for p in model.parameters()), flops_per_token(model, size)
    fused = bool(build_inner_optimizer(InnerConfig(), model).defaults.get("fused"))
    del model
    print(
        f"gpu bench: {device_name} (peak {peak_tflops or '?'} TFLOP/s bf16"
        f"{', from ' + peak_source if peak_source else ''}), torch {torch.__version__}"
    )
    print(
        f"model: GPT {size.layers} x {size.width}, context {size.context}, vocabulary {size.vocab}: "
        f"{params / 1e6:.1f}M params; batch {size.batch} x {size.context}; bf16 autocast, "
        f"{'fused' if fused else 'foreach'} AdamW; {flops / 1e9:.2f} GFLOP/token"
    )
    record = {
        "bench": "gpu",
        "device": device.type,
        "device_name": device_name,
        "torch": torch.__version__,
        "size": asdict(size),
        "params": params,
        "precision": "bf16",
        "fused_adamw": fused,
        "flops_per_token": flops,
        "peak_tflops": peak_tflops,
        "peak_tflops_source": peak_source,
        "inner": {},
        "targets": {"mfu": TARGET_MFU, "outer_round_fraction": TARGET_OUTER_FRACTION},
        "complete": False,
    }
    for name in levers:
        record["inner"][name] = measure_lever(LEVERS[name], size, device, flops, peak_tflops)
        _print_lever(name, record["inner"][name], size)
        write_json(out / "gpu.json", {**record, "wall_s": time.perf_counter() - started})  # after every arm
    _summarize(record, size, device)
    record.update(complete=True, wall_s=time.perf_counter() - started)
    print(write_json(out / "gpu.json", record))
    print(f"wrote {out / 'gpu.json'}", file=sys.stderr)
    return 0


def _summarize(record: dict, size: BenchSize, device: torch.device) -> None:
    """The best arm at the base batch (the headline MFU), the best of all, and the outer sync's
    share of a round of the base batch's step; into ``record``."""
    measured = {name: figures for name, figures in record["inner"].items() if "step_s" in figures}
    if not measured:
        raise RuntimeError("no inner-step arm ran; see the lines above")
    at_batch = [f for f in measured.values() if f["batch"] == size.batch] or list(measured.values())
    best = min(at_batch, key=lambda figures: figures["step_s"])
    best_any = max(measured.items(), key=lambda item: item[1]["tokens_per_s"])
    outer = _outer_figures(size, device, best["step_s"])
    outer_fraction = min(figures["round_fraction"] for figures in outer.values())
    peaks = [f["peak_memory_gb"] for f in at_batch if "peak_memory_gb" in f]
    record.update(
        tokens_per_s=best["tokens_per_s"],
        mfu=best["mfu"],
        best_lever=best_any[0],
        best_mfu=best_any[1]["mfu"],
        outer=outer,
        outer_round_fraction=outer_fraction,
        peak_memory_gb=max(peaks) if peaks else None,
        meets={
            "mfu": best_any[1]["mfu"] >= TARGET_MFU if best_any[1]["mfu"] is not None else None,
            "outer_round_fraction": outer_fraction < TARGET_OUTER_FRACTION,
        },
    )
    if best_any[1]["mfu"] is not None:
        print(f"best arm: {best_any[0]}, MFU {best_any[1]['mfu']:.1%} (target >= {TARGET_MFU:.0%})")
    if record["peak_memory_gb"] is not None:
        print(f"peak GPU memory (inner steps, batch {size.batch}): {record['peak_memory_gb']:.2f} GB")


def run_from_args(args: argparse.Namespace) -> int:
    """Run with the flags of ``add_arguments``."""
    size = SMOKE if args.smoke else BenchSize()
    chosen = {"batch": args.batch, "steps": args.steps, "repeats": args.repeats, "sync_every": args.sync_every}
    size = replace(size, **{key: value for key, value in chosen.items() if value is not None})
    return run_gpu_benchmark(
        size=size,
        out=Path(args.out),
        allow_cpu=args.allow_cpu or args.smoke,
        peak_tflops=args.peak_tflops,
        levers=_chosen_levers(args),
    )


def _chosen_levers(args: argparse.Namespace) -> tuple[str, ...]:
    """``--levers`` as given, or the defaults less the compiled arms on the CPU; with ``--no-compile``
    only the eager arm."""
    names = tuple(args.levers.split(",")) if args.levers else SMOKE_LEVERS if args.smoke else DEFAULT_LEVERS
    unknown = [name for name in names if name not in LEVERS]
    if unknown:
        raise UsageError(f"--levers: {', '.join(unknown)} not among {', '.join(LEVERS)}")
    if args.no_compile or (not args.levers and not torch.cuda.is_available()):
        names = tuple(name for name in names if LEVERS[name].compile_mode is None) or ("eager",)
    return names


def add_arguments(parser) -> None:
    """``diloco bench gpu``'s flags."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU too (checks the code path)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a CUDA device (the figures mean nothing)")
    parser.add_argument("--batch", type=int, help="sequences per inner step (default 16)")
    parser.add_argument("--steps", type=int, help="timed inner steps per repeat (default 20)")
    parser.add_argument("--repeats", type=int, help="repeats of the timed steps (default 3)")
    parser.add_argument("--sync-every", type=int, help="H, for the outer sync's share of a round (default 100)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: by its name)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile arms")
    parser.add_argument(
        "--levers", help=f"comma-separated arms among {', '.join(LEVERS)} (default: {', '.join(DEFAULT_LEVERS)})"
    )
    parser.add_argument("--out", default="runs/bench-gpu", help="output folder (gpu.json)")


def main(args: argparse.Namespace) -> int:
    """``diloco bench gpu``."""
    try:
        return run_from_args(args)
    except NoCudaDevice as error:
        raise UsageError(str(error)) from None


def standalone(argv: list[str] | None = None) -> int:
    """``python -m diloco.bench.gpu`` where only torch is installed: the same flags, without the
    command line's config loader (omegaconf) and transports (hivemind)."""
    parser = argparse.ArgumentParser(prog="python -m diloco.bench.gpu", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args(argv))
    except (NoCudaDevice, UsageError) as error:
        print(f"diloco: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(standalone())
