"""The GPU path: bf16 autocast inner steps, fused AdamW, where the outer step's global copy lives,
and ``diloco bench gpu``. Everything that runs on a CPU is tested here on the CPU; what needs CUDA
(pinned memory, non-blocking copies, the fused kernel, torch.compile) skips without it."""

from __future__ import annotations

import json

import pytest
import torch

from diloco.cli import main
from diloco.comm.base import Averaging, Outcome, SyncResult
from diloco.config import ConfigError, load_config
from diloco.core.digest import tensors_digest
from diloco.core.inner import InnerConfig, autocast, build_inner_optimizer, inner_step
from diloco.core.outer import OuterConfig, OuterStep
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model
from diloco.worker.checkpoint import load_latest_checkpoint, save_checkpoint
from diloco.worker.faults import StopRequested

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Alone(Averaging):
    """One worker: the mean of its pseudo-gradient is itself."""

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        return SyncResult(Outcome.AVERAGED, peers=1, total_weight=weight)


def _batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, TINY.block_size + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _train(model, optimizer, steps: int, *, precision: str, device: str = "cpu") -> list[float]:
    batch = _batch(device)
    return [
        inner_step(model, optimizer, batch, lr=3e-3, grad_clip=1.0, precision=precision).item() for _ in range(steps)
    ]


def _sync(outer: OuterStep, round_index: int) -> None:
    outer.sync(Alone(), weight=1.0, round_index=round_index, deadline_s=10.0)


def test_bf16_inner_steps_on_cpu_reduce_the_loss_and_keep_fp32_master_params():
    torch.manual_seed(0)
    model = build_model(TINY)
    optimizer = build_inner_optimizer(InnerConfig(), model)
    with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):
        logits, _ = model(_batch()[0])
    assert logits.dtype == torch.bfloat16  # the forward really ran in bf16

    losses = _train(model, optimizer, 25, precision="bf16")

    assert losses[-1] < 0.8 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())


def test_fp32_precision_changes_nothing():
    """The default path is the one the bit-exact tests pin: no autocast at all."""
    results = []
    for precision in ("fp32", None):
        torch.manual_seed(0)
        model = build_model(TINY)
        optimizer = build_inner_optimizer(InnerConfig(), model)
        batch = _batch()
        kwargs = {} if precision is None else {"precision": precision}
        for _ in range(3):
            inner_step(model, optimizer, batch, lr=1e-3, grad_clip=1.0, **kwargs)
        results.append(tensors_digest(model.parameters()))
    assert results[0] == results[1]


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["worker.precision=fp16"], "worker.precision"),
        (["outer.global_device=gpu"], "outer.global_device"),
        (["outer.global_device=model", "outer.overlap=delayed"], "outer.overlap=none"),
        (["worker.gpu_memory_fraction=1.5"], "worker.gpu_memory_fraction"),
    ],
)
def test_bad_gpu_settings_are_one_line_config_errors(overrides, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")) as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value)


def test_fused_adamw_is_left_off_on_cpu():
    optimizer = build_inner_optimizer(InnerConfig(), build_model(TINY))
    assert not optimizer.defaults.get("fused")


@pytest.mark.parametrize("global_device", ["cpu", "model"])
def test_global_copy_sits_on_the_chosen_device_and_resumes_bit_exact(tmp_path, global_device):
    """A checkpoint taken mid-run (CPU tensors whatever the device) continues exactly like the run."""
    cfg = OuterConfig(global_device=global_device)
    torch.manual_seed(0)
    model = build_model(TINY)
    inner = build_inner_optimizer(InnerConfig(), model)
    outer = OuterStep(list(model.parameters()), cfg)
    assert all(
        g.device == p.device and g.dtype == torch.float32 for g, p in zip(outer.global_params, model.parameters())
    )
    _train(model, inner, 3, precision="bf16")
    _sync(outer, 0)
    save_checkpoint(
        tmp_path, 0, 1, {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}
    )
    _train(model, inner, 3, precision="bf16")
    _sync(outer, 1)

    state = load_latest_checkpoint(tmp_path, 0)
    assert all(t.device.type == "cpu" for t in state["outer"]["global_params"])
    resumed = build_model(TINY)
    resumed.load_state_dict(state["model"])
    resumed_inner = build_inner_optimizer(InnerConfig(), resumed)
    resumed_inner.load_state_dict(state["inner"])
    resumed_outer = OuterStep(list(resumed.parameters()), cfg)
    resumed_outer.load_state_dict(state["outer"])
    _train(resumed, resumed_inner, 3, precision="bf16")
    _sync(resumed_outer, 1)

    assert tensors_digest(resumed_outer.global_params) == tensors_digest(outer.global_params)
    assert tensors_digest(resumed.parameters()) == tensors_digest(model.parameters())


def test_a_bf16_worker_with_the_global_copy_beside_the_model_resumes_bit_exact(tmp_path):
    """train() end to end (simulated transport, one worker): the new keys reach the loop and the checkpoint."""
    from diloco.worker.train import train

    common = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "inner.batch_size=4",
        "inner.steps=20",
        "outer.sync_every=5",
        "data.max_bytes=50000",
        "logging.eval_batches=1",
        "checkpoint.every_rounds=1",
        "comm.backend=simulator",
        "worker.precision=bf16",
        "outer.global_device=model",
    ]
    straight = train(load_config(None, [*common, f"run.dir={tmp_path / 'a'}", "comm.run_id=gpu_a"]))
    with pytest.raises(StopRequested):
        train(
            load_config(None, [*common, f"run.dir={tmp_path / 'b'}", "comm.run_id=gpu_b", "faults.stop_after_round=2"])
        )
    resumed = train(load_config(None, [*common, f"run.dir={tmp_path / 'b'}", "comm.run_id=gpu_c"]))
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["val_loss"] == straight["val_loss"]


def test_bench_gpu_smoke_runs_on_cpu_and_prints_one_json_line(tmp_path, capsys):
    assert main(["bench", "gpu", "--smoke", "--allow-cpu", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert sum(line.startswith("{") for line in lines) == 1
    expected = {"tokens_per_s", "mfu", "outer", "outer_round_fraction", "peak_memory_gb", "targets", "meets", "params"}
    assert expected <= record.keys()
    assert record["bench"] == "gpu" and record["tokens_per_s"] > 0
    assert set(record["outer"]) == {"cpu", "model"} and record["targets"] == {"mfu": 0.45, "outer_round_fraction": 0.01}
    assert json.loads((tmp_path / "gpu.json").read_text()) == record


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_bench_gpu_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "gpu", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "no CUDA device is visible" in captured.err
    assert captured.out == "" and not (tmp_path / "gpu.json").exists()


def test_peak_flops_come_from_the_device_name():
    from diloco.bench.gpu import peak_tflops_for

    assert peak_tflops_for("NVIDIA H200") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_for("Some Future GPU") is None


@needs_cuda
def test_on_cuda_adamw_is_fused_and_bf16_steps_keep_fp32_params():
    torch.manual_seed(0)
    model = build_model(TINY).cuda()
    optimizer = build_inner_optimizer(InnerConfig(), model)
    assert optimizer.defaults["fused"] is True
    losses = _train(model, optimizer, 25, precision="bf16", device="cuda")
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


@needs_cuda
def test_on_cuda_the_global_copy_is_pinned_and_syncs_match_the_cpu_math():
    torch.manual_seed(0)
    model = build_model(TINY).cuda()
    outer = OuterStep(list(model.parameters()), OuterConfig())
    assert all(g.device.type == "cpu" and g.is_pinned() for g in outer.global_params)
    _train(model, build_inner_optimizer(InnerConfig(), model), 3, precision="bf16", device="cuda")
    want = [g - p.detach().cpu() for g, p in zip(outer.global_params, model.parameters())]
    got = outer.pseudo_gradients()
    assert all(t.is_pinned() and torch.equal(t, w) for t, w in zip(got, want))
    _sync(outer, 0)
    torch.cuda.synchronize()  # the copy back was queued, not awaited
    assert all(torch.equal(p.detach().cpu(), g) for p, g in zip(model.parameters(), outer.global_params))


@needs_cuda
def test_on_cuda_global_device_model_keeps_the_copy_on_the_gpu_and_serves_cpu_state():
    torch.manual_seed(0)
    model = build_model(TINY).cuda()
    outer = OuterStep(list(model.parameters()), OuterConfig(global_device="model"))
    assert all(g.is_cuda for g in outer.global_params)
    _train(model, build_inner_optimizer(InnerConfig(), model), 3, precision="bf16", device="cuda")
    assert all(t.device.type == "cpu" for t in outer.pseudo_gradients())
    _sync(outer, 0)
    state = outer.state_dict()
    assert all(t.device.type == "cpu" for t in state["global_params"])
    assert all(s["momentum_buffer"].device.type == "cpu" for s in state["optimizer"]["state"].values())


@needs_cuda
def test_on_cuda_a_compiled_model_keeps_its_state_dict_keys():
    model = build_model(TINY).cuda()
    keys = list(model.state_dict())
    model.compile()
    _train(model, build_inner_optimizer(InnerConfig(), model), 2, precision="bf16", device="cuda")
    assert list(model.state_dict()) == keys


def test_the_gpu_estimate_counts_each_workers_activations(monkeypatch):
    import diloco.worker.memory as memory

    gpt_111m = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    activations = memory.activation_bytes(gpt_111m, vocab_size=32768, batch_size=16)
    # between what bench gpu measured on an H200 at batch 16: 8.6 GB compiled, 12.7 GB eager
    assert 8.6e9 < activations < 12.7e9
    assert memory.activation_bytes(ModelConfig(kind="hf"), vocab_size=32768, batch_size=16) == 0
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**40)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 2**30, 141 * 2**30))
    fits = {"vocab_size": 32768, "device": torch.device("cuda"), "batch_size": 16}
    memory.check_model_fits(gpt_111m, workers_here=3, **fits)  # 3 x (1.7 GiB + 9.6 GiB) < 40 GiB
    with pytest.raises(ConfigError) as error:
        memory.check_model_fits(gpt_111m, workers_here=4, global_on_gpu=True, **fits)
    assert "4 workers sharing cuda need about 48.4 GiB of GPU memory" in str(error.value)
    assert "40.0 GiB is free on cuda; lower inner.batch_size, run fewer workers" in str(error.value)
    memory.check_model_fits(gpt_111m, workers_here=4, global_on_gpu=True, stepping_at_once=1, **fits)  # simulated
    with pytest.raises(ConfigError, match="and 28.2 GiB is its share on cuda"):
        memory.check_model_fits(gpt_111m, gpu_share=0.2, **{**fits, "batch_size": 64})  # about 41 GiB, over 0.2 x 141
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("device", "workers", "share"),
    [("cuda", 4, ["worker.gpu_memory_fraction=0.250000"]), ("cuda", 1, []), ("cpu", 4, [])],
)
def test_workers_sharing_a_gpu_each_take_their_share(device, workers, share, monkeypatch):
    from diloco.tools.launcher import _gpu_share

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _gpu_share(load_config(None, [f"worker.device={device}"]), workers) == share
    assert _gpu_share(load_config(None, ["worker.device=cuda", "worker.gpu_memory_fraction=0.5"]), 4) == []


def test_a_gpu_out_of_memory_is_one_line(monkeypatch, capsys):
    import diloco.cli

    def out_of_memory(args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setitem(diloco.cli.COMMANDS, "config", out_of_memory)
    assert main(["config"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("diloco: error: the GPU ran out of memory")
    assert "lower inner.batch_size" in captured.err and "resumes from the last checkpoint" in captured.err
