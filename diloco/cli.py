"""The ``diloco`` command.

    diloco local configs/tiny.yaml --workers 4              # M workers on this machine, then a summary
    diloco testbed configs/tiny.yaml --workers 4 --rate 20  # the same on shaped links (root)
    diloco train configs/tiny.yaml [KEY=VALUE ...]          # one worker (start a run, or join one
                                                            #   with comm.initial_peers=[...])
    diloco join configs/tiny.yaml --peers ADDR [KEY=VALUE]  # a volunteer joins a live run in a free slot
    diloco join --peers ADDR [KEY=VALUE]                    # the same, the run's config taken from a peer
    diloco bootstrap --host 0.0.0.0 --port 31337            # a DHT peer others can join through
    diloco config [CONFIG] [KEY=VALUE ...]                  # print the resolved configuration
    diloco config --reference                               # every key, type, default, meaning
    diloco plot runs/a runs/b --out curves.png              # loss against tokens, time and bytes
    diloco bench overhead                                   # inner-step throughput vs a bare loop
    diloco bench quality                                    # DiLoCo vs data-parallel at equal tokens
    diloco bench compression                                # each codec vs dense DiLoCo
    diloco bench utilization                                # overlap strategies on shaped links (root)
    diloco bench gpu                                        # one GPU: inner-step MFU, outer sync's local work

Mistakes in the command line, the config or the data path end with one line on stderr and
exit code 2; Ctrl-C stops everything this command started and exits 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from diloco.errors import UsageError, UserError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description="DiLoCo training over slow links.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run one worker")
    train.add_argument("config", nargs="?", help="YAML config (a diff from the defaults)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE")

    join = commands.add_parser("join", help="join a live run in a free slot, starting from the run's current state")
    join.add_argument("config", nargs="?", help="the run's YAML config (default: taken from a live peer)")
    join.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    join.add_argument("--peers", required=True, help="multiaddr(s) of live peers of the run, comma-separated")

    status = commands.add_parser("status", help="list the live workers of a run: round, steps, loss, tokens/s")
    status.add_argument("config", nargs="?", help="the run's YAML config (for its run id and run key)")
    status.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    status.add_argument("--peers", required=True, help="multiaddr(s) of live peers of the run, comma-separated")
    status.add_argument("--run-id", help="the run's comm.run_id (default: the config's)")
    status.add_argument("--watch", action="store_true", help="refresh every few seconds until Ctrl-C")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)")

    local = commands.add_parser("local", help="run a bootstrap peer and M workers on this machine")
    local.add_argument("config", nargs="?", help="YAML config (a diff from the defaults)")
    local.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    local.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    local.add_argument("--run-dir", help="run directory (default runs/<run.name>)")

    testbed = commands.add_parser(
        "testbed", help="like local, each worker in its own network namespace on a shaped link (root)"
    )
    testbed.add_argument("config", nargs="?", help="YAML config (a diff from the defaults)")
    testbed.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    testbed.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    testbed.add_argument("--rate", type=float, default=0.0, help="each link's rate both ways, Mbit/s (0 = unshaped)")
    testbed.add_argument("--up", type=float, help="each worker's upload rate, Mbit/s (default --rate)")
    testbed.add_argument("--down", type=float, help="each worker's download rate, Mbit/s (default --rate)")
    testbed.add_argument("--run-dir", help="run directory (default runs/<run.name>)")
    testbed.add_argument(
        "--nat", default="", help="workers behind a home router (NAT, nothing can dial in), e.g. 1,2 (default none)"
    )

    bootstrap = commands.add_parser("bootstrap", help="run a DHT peer that workers can join through")
    bootstrap.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    bootstrap.add_argument("--port", type=int, default=31337, help="TCP port (default 31337)")

    config = commands.add_parser("config", help="print the resolved configuration")
    config.add_argument(
        "--show",
        "--reference",
        dest="show",
        action="store_true",
        help="every key with its type, default and meaning (and its value in CONFIG, when given)",
    )
    config.add_argument("config", nargs="?", help="YAML config")
    config.add_argument("overrides", nargs="*", metavar="KEY=VALUE")

    plot = commands.add_parser("plot", help="validation loss against tokens, wall time and bytes")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", required=True, help="PNG file to write")

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    overhead = bench.add_parser("overhead", help="inner-step throughput against a bare PyTorch loop")
    overhead.add_argument("--steps", type=int, default=150, help="timed steps per repeat")
    overhead.add_argument("--repeats", type=int, default=7)
    quality = bench.add_parser("quality", help="DiLoCo against data-parallel training at equal tokens")
    quality.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every arm")
    quality.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    quality.add_argument("--steps", type=int, default=2000, help="inner steps per worker (default 2000)")
    quality.add_argument("--seeds", type=int, default=3, help="how many seeds (default 3)")
    quality.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    quality.add_argument("--arms", help="comma-separated arm names (default: all)")
    quality.add_argument("--out", default="runs/bench-quality", help="output folder")
    quality.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    quality.add_argument("--device", default="auto", help="cpu / cuda / auto")
    faults = bench.add_parser("faults", help="crash, cut link, slow link, join, bad and wrong-key peers, 4 workers")
    faults.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    faults.add_argument("--scenarios", default="crash,cut,slow,join,bad,wrong_key", help="comma-separated")
    faults.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    faults.add_argument("--workers", type=int, default=4)
    faults.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    faults.add_argument("--sync-every", type=int, default=20, help="H")
    faults.add_argument("--outage", type=float, default=20.0, help="seconds a crashed worker or a cut link stays out")
    faults.add_argument("--join-round", type=int, default=5)
    faults.add_argument("--rate", type=float, help="testbed link rate, Mbit/s (default 20 as root, else loopback)")
    faults.add_argument("--out", default="runs/bench-faults", help="output folder")
    nat = bench.add_parser("nat", help="rounds and utilization with 0-3 of 4 workers behind NAT (testbed, root)")
    nat.add_argument("--nat", default="0,1,2,3", help="how many of the 4 workers are behind NAT, per arm")
    nat.add_argument("--workers", type=int, default=4, help="workers per arm (default 4)")
    nat.add_argument("--rate", type=float, default=20.0, help="each link's rate both ways, Mbit/s (default 20)")
    nat.add_argument("--steps", type=int, default=200, help="inner steps per worker (default 200)")
    nat.add_argument("--out", default="runs/bench-nat", help="output folder")
    scale = bench.add_parser("scale", help="a round's cost at real model sizes against stock hivemind and gloo")
    scale.add_argument("--sizes", default="baby,10m,85m", help="baby, 10m, 85m, llama-150m (default baby,10m,85m)")
    scale.add_argument("--steps", type=int, default=8, help="inner steps per worker (default 8)")
    scale.add_argument("--sync-every", type=int, default=2, help="H (default 2)")
    scale.add_argument("--compare-rounds", type=int, default=3, help="rounds of each baseline, the first a warm-up")
    scale.add_argument("--out", default="runs/bench-scale", help="output folder")
    utilization = bench.add_parser(
        "utilization", help="compute utilization of each overlap strategy on shaped links, all-reduce efficiency (root)"
    )
    utilization.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    utilization.add_argument("--steps", type=int, default=200, help="inner steps per training run (default 200)")
    utilization.add_argument("--rates", default="20,5", help="link rates of the training runs, Mbit/s (default 20,5)")
    utilization.add_argument("--codecs", default="none,int8", help="codecs of the training runs (default none,int8)")
    utilization.add_argument("--overlaps", default="none,streaming,delayed", help="outer.overlap values")
    utilization.add_argument("--peers", default="2,4,8", help="all-reduce group sizes (default 2,4,8)")
    utilization.add_argument("--payload-mb", type=float, default=40.0, help="all-reduce payload, MB (default 40)")
    utilization.add_argument("--allreduce-rate", type=float, default=20.0, help="all-reduce link rate, Mbit/s")
    utilization.add_argument("--rounds", type=int, default=3, help="all-reduce rounds, the first a warm-up")
    utilization.add_argument("--parts", default="training,allreduce", help="training, allreduce or both")
    utilization.add_argument("--out", default="runs/bench-utilization", help="output folder")
    gpu = bench.add_parser("gpu", help="one GPU: inner-step tokens/s and MFU, the outer sync's local work")
    gpu.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU too (checks the code path)")
    gpu.add_argument("--allow-cpu", action="store_true", help="run without a CUDA device (the figures mean nothing)")
    gpu.add_argument("--batch", type=int, help="sequences per inner step (default 16)")
    gpu.add_argument("--steps", type=int, help="timed inner steps per repeat (default 20)")
    gpu.add_argument("--repeats", type=int, help="repeats of the timed steps (default 3)")
    gpu.add_argument("--sync-every", type=int, help="H, for the outer sync's share of a round (default 100)")
    gpu.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: by its name)")
    gpu.add_argument("--no-compile", action="store_true", help="skip the torch.compile arm")
    gpu.add_argument("--out", default="runs/bench-gpu", help="output folder (gpu.json)")
    compression = bench.add_parser("compression", help="each compression codec against dense DiLoCo (M=4, H=50)")
    compression.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every arm")
    compression.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    compression.add_argument("--steps", type=int, default=2000, help="inner steps per worker (default 2000)")
    compression.add_argument("--seeds", type=int, default=3, help="how many seeds (default 3)")
    compression.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    compression.add_argument("--out", default="runs/bench-compression", help="output folder")
    compression.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    compression.add_argument("--device", default="auto", help="cpu / cuda / auto")
    compression.add_argument(
        "--speed-values", type=int, default=10_000_000, help="values in the codec speed test (default 10M)"
    )
    return parser


def _seeds(args: argparse.Namespace) -> range:
    """The seeds a training benchmark runs: ``--seeds`` of them from ``--first-seed``."""
    if args.seeds < 1 or args.first_seed < 0:
        raise UsageError(f"--seeds {args.seeds} --first-seed {args.first_seed}: need at least one seed, from 0 up")
    return range(args.first_seed, args.first_seed + args.seeds)


def _split_config(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``diloco train inner.lr=1e-3`` has no config file: the first positional is an override."""
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, overrides


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _cmd_train(args, *, join: bool = False) -> int:
    from diloco.config import load_config
    from diloco.worker.faults import StopRequested
    from diloco.worker.train import train

    config_path, overrides = _split_config(args.config, args.overrides)
    cfg = load_config(config_path, overrides)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not cfg.worker.site:
        # under torchrun each rank is a worker (comm.backend=torchdist), unless the ranks are one site
        overrides = [f"worker.index={os.environ['RANK']}", f"worker.count={os.environ['WORLD_SIZE']}", *overrides]
        cfg = load_config(config_path, overrides)

    def announce(addresses: list[str]) -> None:
        if addresses:
            peers = ",".join(f"'{a}'" for a in addresses)
            print(
                f"worker {cfg.worker.index} is up; join this run with: comm.initial_peers=[{peers}]",
                flush=True,
            )

    try:
        end = train(cfg, on_ready=announce, join=join)
    except StopRequested as stop:
        print(f"worker {cfg.worker.index} stopped: {stop}", flush=True)
        return 3
    print(
        f"worker {cfg.worker.index} finished: {end['inner_steps']} steps, {end['rounds']} rounds, "
        f"val_loss {end['val_loss']:.4f}, params {end['param_sha256'][:16]}",
        flush=True,
    )
    return 0


def _cmd_join(args) -> int:
    import tempfile

    from omegaconf import OmegaConf

    from diloco.comm.hivemind.backend import probe_roster
    from diloco.comm.hivemind.roster import free_slot, nobody_answered
    from diloco.config import load_config
    from diloco.worker.joining import JoinError, config_digest, config_from_run

    config_path, overrides = _split_config(args.config, args.overrides)
    overrides = _peer_overrides(overrides, args.peers)
    cfg = load_config(config_path, overrides)
    if cfg.comm.backend != "hivemind":
        raise UsageError(f"joining a live run needs comm.backend=hivemind, not {cfg.comm.backend}")
    entries = {i: e for i, e in probe_roster(cfg.comm, timeout_s=cfg.comm.matchmaking_s).items() if not e.leaving}
    if not entries:
        raise JoinError(nobody_answered(cfg.comm.run_id, cfg.comm.initial_peers, cfg.comm.matchmaking_s))
    # the run's plan and slots are the run's, whatever the joiner's own file says
    planned = max((e.planned for e in entries.values()), default=0) or cfg.worker.count
    slots = max((e.slots for e in entries.values()), default=0) or cfg.worker.shards
    slot = free_slot(entries, slots)
    if slot is None:
        raise UsageError(
            f"run {cfg.comm.run_id!r} is full: its {slots} data shards are all held by live workers "
            f"(a run takes volunteers up to its worker.slots)"
        )
    print(f"joining run {cfg.comm.run_id!r} as worker {slot} ({len(entries)} live)", flush=True)
    args.overrides = [*overrides, f"worker.count={planned}", f"worker.slots={slots}", f"worker.index={slot}"]
    if config_path is not None:
        args.config = config_path
        return _cmd_train(args, join=True)
    # no config file: the run's own, from a live peer, with this volunteer's overrides on top
    tree = config_from_run(entries, cfg.comm.run_id)
    with tempfile.TemporaryDirectory(prefix="diloco-join-") as folder:
        args.config = str(Path(folder) / "run-config.yaml")
        Path(args.config).write_text(OmegaConf.to_yaml(tree))
        print(f"took the run's config from a live peer (sha256 {config_digest(tree)[:12]})", flush=True)
        return _cmd_train(args, join=True)


def _peer_overrides(overrides: list[str], peers_option: str) -> list[str]:
    """The overrides with ``--peers A,B`` as ``comm.initial_peers``."""
    peers = [peer.strip() for peer in peers_option.split(",") if peer.strip()]
    if not peers:
        raise UsageError("--peers needs at least one multiaddr of a live peer")
    return [*overrides, "comm.initial_peers=[" + ",".join(f"'{p}'" for p in peers) + "]"]


def _cmd_status(args) -> int:
    from diloco.config import load_config
    from diloco.tools.status import show_status

    config_path, overrides = _split_config(args.config, args.overrides)
    overrides = _peer_overrides(overrides, args.peers)
    if args.run_id:
        overrides.append(f"comm.run_id={args.run_id}")
    cfg = load_config(config_path, [*overrides, "comm.port=0", "comm.client_mode=true"])
    return show_status(cfg.comm, watch=args.watch, timeout_s=args.timeout)


def _local_run_config(args):
    """``diloco local`` / ``testbed``'s config, checked here (with its data) rather than in M workers:
    (cfg, config path, the overrides every worker gets)."""
    import torch

    from diloco.config import load_config
    from diloco.data.corpus import load_corpus
    from diloco.worker.memory import check_model_fits

    if args.workers < 1:
        raise UsageError(f"--workers={args.workers} must be at least 1")
    config_path, overrides = _split_config(args.config, args.overrides)
    if args.run_dir:
        overrides = [*overrides, f"run.dir={args.run_dir}"]
    cfg = load_config(config_path, [*overrides, f"worker.count={args.workers}"])
    corpus = load_corpus(cfg.data)
    on_gpu = cfg.worker.device != "cpu" and torch.cuda.is_available()  # the workers all on one machine
    device = torch.device("cuda" if on_gpu else "cpu")
    check_model_fits(cfg.model, vocab_size=corpus.vocab_size, device=device, workers_here=args.workers)
    return cfg, config_path, overrides


def _cmd_local(args) -> int:
    from diloco.tools.launcher import run_inproc, run_local

    cfg, config_path, overrides = _local_run_config(args)
    if cfg.comm.backend == "inproc":
        return run_inproc(cfg, workers=args.workers)
    return run_local(cfg, config_path, overrides, workers=args.workers)


def _cmd_testbed(args) -> int:
    from diloco.tools.launcher import run_local
    from diloco.tools.testbed import Testbed, TestbedError

    up, down = args.rate if args.up is None else args.up, args.rate if args.down is None else args.down
    if min(up, down) < 0:
        raise UsageError("link rates (--rate, --up, --down) must be >= 0 Mbit/s")
    cfg, config_path, overrides = _local_run_config(args)
    if cfg.comm.backend != "hivemind":
        raise UsageError(f"the testbed runs real peers: comm.backend must be hivemind, not {cfg.comm.backend}")
    try:
        nat = _numbers(args.nat, int, "--nat") if args.nat else []
        testbed = Testbed(args.workers, up_mbit=up, down_mbit=down, nat=nat)
    except TestbedError as error:
        raise UsageError(str(error)) from None
    with testbed:
        return run_local(cfg, config_path, overrides, workers=args.workers, testbed=testbed)


def _cmd_bootstrap(args) -> int:
    import threading

    from diloco.comm.base import CommConfig
    from diloco.comm.hivemind import reachability
    from diloco.comm.hivemind.backend import bounded_dht_call, start_dht, visible_addresses

    dht = start_dht(CommConfig(host=args.host, port=args.port), initial_peers=[])
    try:
        for address in visible_addresses(dht):
            print(f"bootstrap peer up: comm.initial_peers=['{address}']", flush=True)
        # until Ctrl-C or SIGTERM: dial back the workers that ask whether they are reachable
        dht_call, answered, never = bounded_dht_call(dht, threading.Lock(), timeout_s=10.0), {}, threading.Event()
        while not never.wait(1.0):
            try:
                reachability.answer(dht_call, own_peer_id=str(dht.peer_id), answered=answered)
            except Exception:  # the DHT did not answer this time: the next second may
                logging.getLogger(__name__).debug("dial-back round failed", exc_info=True)
    finally:
        dht.shutdown()
    return 0


def _cmd_config(args) -> int:
    from diloco.config import load_config, masked, to_yaml

    config_path, overrides = _split_config(args.config, args.overrides)
    if args.show:
        from diloco.config_reference import reference_markdown

        given = config_path is not None or bool(overrides)
        print(reference_markdown(masked(load_config(config_path, overrides)) if given else None), end="")
        return 0
    print(to_yaml(load_config(config_path, overrides)), end="")
    return 0


def _cmd_plot(args) -> int:
    from diloco.tools.plot import load_curve, plot_curves

    curves = [load_curve(Path(run_dir)) for run_dir in args.run_dirs]
    print(f"wrote {plot_curves(curves, Path(args.out))}")
    return 0


def _numbers(text: str, kind: type, option: str) -> list:
    """A comma-separated list of numbers from the command line."""
    try:
        return [kind(word) for word in text.split(",")]
    except ValueError:
        raise UsageError(f"{option}={text!r} is not a comma-separated list of {kind.__name__} numbers") from None


def _cmd_bench(args) -> int:
    if args.bench == "overhead":
        from diloco.bench.overhead import run_overhead_benchmark

        return run_overhead_benchmark(steps=args.steps, repeats=args.repeats)
    if args.bench == "faults":
        from diloco.bench.faults import run_faults_benchmark

        return run_faults_benchmark(
            scenarios=[s for s in args.scenarios.split(",") if s],
            out=Path(args.out),
            data=args.data,
            overrides=args.overrides,
            workers=args.workers,
            steps=args.steps,
            sync_every=args.sync_every,
            outage_s=args.outage,
            join_round=args.join_round,
            rate_mbit=args.rate,
        )
    if args.bench == "nat":
        from diloco.bench.nat import run_nat_benchmark

        return run_nat_benchmark(
            arms=_numbers(args.nat, int, "--nat"),
            workers=args.workers,
            rate=args.rate,
            steps=args.steps,
            out=Path(args.out),
        )
    if args.bench == "scale":
        from diloco.bench.scale import run_scale_benchmark

        return run_scale_benchmark(
            sizes=[size for size in args.sizes.split(",") if size],
            steps=args.steps,
            sync_every=args.sync_every,
            compare_rounds=args.compare_rounds,
            out=Path(args.out),
        )
    if args.bench == "utilization":
        from diloco.bench.utilization import run_utilization_benchmark

        return run_utilization_benchmark(
            data=args.data,
            steps=args.steps,
            rates=_numbers(args.rates, float, "--rates"),
            codecs=args.codecs.split(","),
            overlaps=args.overlaps.split(","),
            peers=_numbers(args.peers, int, "--peers"),
            payload_mb=args.payload_mb,
            allreduce_rate=args.allreduce_rate,
            rounds=args.rounds,
            parts=args.parts.split(","),
            out=Path(args.out),
        )
    if args.bench == "gpu":
        from diloco.bench.gpu import NoCudaDevice, run_from_args

        try:
            return run_from_args(args)
        except NoCudaDevice as error:
            raise UsageError(str(error)) from None
    if args.bench == "compression":
        from diloco.bench.compression import run_compression_benchmark

        return run_compression_benchmark(
            data=args.data,
            steps=args.steps,
            seeds=_seeds(args),
            out=Path(args.out),
            jobs=args.jobs,
            device=args.device,
            overrides=args.overrides,
            speed_values=args.speed_values,
        )
    from diloco.bench.quality import run_quality_benchmark

    return run_quality_benchmark(
        data=args.data,
        steps=args.steps,
        seeds=_seeds(args),
        arms=args.arms.split(",") if args.arms else None,
        out=Path(args.out),
        jobs=args.jobs,
        device=args.device,
        overrides=args.overrides,
    )


COMMANDS = {
    "train": _cmd_train,
    "status": _cmd_status,
    "local": _cmd_local,
    "join": _cmd_join,
    "testbed": _cmd_testbed,
    "bootstrap": _cmd_bootstrap,
    "config": _cmd_config,
    "plot": _cmd_plot,
    "bench": _cmd_bench,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse cannot take positionals after options (``--workers 4 inner.lr=1``); collect those
    stray ``KEY=VALUE`` words as overrides, and reject anything else."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("hivemind").setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    os.environ.setdefault("WANDB_SILENT", "true")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    # a shell starts background jobs with SIGINT ignored, and children inherit that: restore Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        return COMMANDS[args.command](args)
    except UserError as error:  # errors.py: every mistake the user has to fix
        print(f"diloco: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
