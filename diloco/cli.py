"""The ``diloco`` command.

    diloco local configs/tiny.yaml --workers 4              # M workers on this machine, then a summary
    diloco testbed configs/tiny.yaml --workers 4 --rate 20  # the same on shaped links (root)
    diloco launch --workers 4 [CONFIG] -- python train.py   # your own script as 4 workers (diloco.init())
    diloco launch --join ADDR [CONFIG] -- python train.py   # ... as a volunteer joining a live run
    diloco train configs/tiny.yaml [KEY=VALUE ...]          # one worker (start a run, or join one
                                                            #   with comm.hivemind.initial_peers=[...])
    diloco join configs/tiny.yaml --peers ADDR [KEY=VALUE]  # a volunteer joins a live run in a free slot
    diloco join --peers ADDR [KEY=VALUE]                    # the same, the run's config taken from a peer
    diloco bootstrap --host 0.0.0.0 --port 31337            # a DHT peer others can join through
    diloco config [CONFIG] [KEY=VALUE ...]                  # print the resolved configuration
    diloco config --reference                               # every key, type, default, meaning
    diloco summary runs/tiny                                # a run at a glance from its records, live or ended
    diloco plot runs/a runs/b --out curves.png              # loss against tokens, time and bytes
    diloco corpus runs/pycorpus [--vocab 32768]             # site-packages' Python source, a BPE, a token cache
    diloco bench overhead                                   # inner-step throughput vs a bare loop
    diloco bench quality                                    # DiLoCo vs data-parallel at equal tokens
    diloco bench compression                                # each codec vs dense DiLoCo
    diloco bench utilization                                # overlap strategies on shaped links (root)
    diloco bench gpu                                        # one GPU: inner-step MFU, outer sync's local work

Mistakes in the command line, the config or the data path end with one line on stderr and
exit code 2. Ctrl-C, or SIGTERM to the process or its whole process group, stops everything this
command started (a worker first marks itself as leaving the run) and exits 130 with one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from diloco.errors import UsageError, UserError, make_folder
from diloco.lifetime import raise_keyboard_interrupt

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _chosen_benchmark(argv: list[str] | None) -> str | None:
    """The NAME of ``diloco bench NAME ...``, whose flags the parser then declares."""
    words = [word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")]
    return words[1] if words[:1] == ["bench"] and len(words) > 1 else None


def _add_launchers(commands) -> None:
    """``diloco local``, ``launch`` and ``testbed``: a run's workers (and helpers) on this machine."""
    local = commands.add_parser("local", help="run a bootstrap peer and M workers on this machine")
    local.add_argument("config", nargs="?", help="YAML config (a diff from the defaults)")
    local.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    local.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    local.add_argument("--run-dir", help="run directory (default runs/<run.name>)")
    local.add_argument("--helpers", type=int, default=0, help="helpers that reduce for the workers (default 0)")

    launch = commands.add_parser(
        "launch",
        help="run your own training script (the command after --) as M workers here, or as a volunteer",
        usage="diloco launch [--workers M | --join ADDR] [--run-dir DIR] [CONFIG] [KEY=VALUE ...] -- COMMAND ...",
    )
    launch.add_argument("config", nargs="?", help="YAML config (a diff from the defaults)")
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    launch.add_argument("--workers", type=int, help="number of workers (default 2)")
    launch.add_argument("--run-dir", help="run directory (default runs/<run.name>)")
    launch.add_argument("--join", metavar="ADDR", help="one worker joining the live run of these peers (a,b,...)")

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
    testbed.add_argument(
        "--helpers", type=int, default=0, help="helpers that reduce for the workers, each on a public link (default 0)"
    )


def _add_run_commands(commands) -> None:
    """``diloco train``, ``join`` and ``status``: one worker of a run, or a look at the run."""
    train = commands.add_parser("train", help="run one worker")
    train.add_argument("config", nargs="?", help="YAML config (a diff from the defaults)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    train.add_argument("--run-dir", help="run directory (default runs/<run.name>; the same as run.dir=DIR)")

    join = commands.add_parser("join", help="join a live run in a free slot, starting from the run's current state")
    join.add_argument("config", nargs="?", help="the run's YAML config (default: taken from a live peer)")
    join.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    join.add_argument("--peers", required=True, help="multiaddr(s) of live peers of the run, comma-separated")
    join.add_argument("--run-dir", help="run directory (default runs/<run.name>; the same as run.dir=DIR)")

    status = commands.add_parser("status", help="list the live workers of a run: round, steps, loss, tokens/s")
    status.add_argument("config", nargs="?", help="the run's YAML config (for its run id and run key)")
    status.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    status.add_argument("--peers", required=True, help="multiaddr(s) of live peers of the run, comma-separated")
    status.add_argument("--run-id", help="the run's comm.run_id (default: the config's)")
    status.add_argument("--watch", action="store_true", help="refresh every few seconds until Ctrl-C")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)")


def _add_tools(commands) -> None:
    """``diloco helper``, ``bootstrap``, ``config``, ``summary``, ``plot`` and ``corpus``."""
    helper = commands.add_parser(
        "helper", help="reduce parts of every round for a live run's workers (a public peer; contributes nothing)"
    )
    helper.add_argument("config", nargs="?", help="the run's YAML config (default: taken from a live peer)")
    helper.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    helper.add_argument("--peers", required=True, help="multiaddr(s) of live peers of the run, comma-separated")
    helper.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for a live worker of the run (default 60)"
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

    summary = commands.add_parser("summary", help="a run at a glance from its records: live or finished")
    summary.add_argument("run_dir", metavar="RUN_DIR")

    plot = commands.add_parser("plot", help="validation loss against tokens, wall time and bytes")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", required=True, help="PNG file to write")

    corpus = commands.add_parser(
        "corpus", help="the installed packages' Python source as a corpus: text shards, a trained BPE, a token cache"
    )
    corpus.add_argument("out_dir", metavar="OUT_DIR", help="folder for text/, tokenizer.json and cache/")
    corpus.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary size (default 32768)")
    corpus.add_argument("--max-bytes", type=int, default=0, help="collect at most this much text (default 0 = all)")


def _parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description="DiLoCo training over slow links.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    _add_run_commands(commands)
    _add_launchers(commands)
    _add_tools(commands)

    from diloco.bench import add_benchmarks

    benchmarks = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_benchmarks(benchmarks, _chosen_benchmark(argv))
    return parser


def _split_config(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``diloco train inner.lr=1e-3`` has no config file: the first positional is an override."""
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, overrides


def _cmd_train(args, *, join: bool = False) -> int:
    from diloco.worker.train import run_worker

    config_path, overrides = _split_config(args.config, args.overrides)
    if args.run_dir:
        overrides = [*overrides, f"run.dir={args.run_dir}"]
    return run_worker(config_path, overrides, join=join)


def _cmd_join(args) -> int:
    from diloco.tools.join import run_join

    config_path, overrides = _split_config(args.config, args.overrides)
    return run_join(config_path, _peer_overrides(overrides, args.peers), run_dir=args.run_dir)


def _peer_overrides(overrides: list[str], peers_option: str, option: str = "--peers") -> list[str]:
    """The overrides with ``--peers A,B`` as ``comm.hivemind.initial_peers``."""
    peers = [peer.strip() for peer in peers_option.split(",") if peer.strip()]
    if not peers:
        raise UsageError(f"{option} needs at least one multiaddr of a live peer")
    return [*overrides, "comm.hivemind.initial_peers=[" + ",".join(f"'{p}'" for p in peers) + "]"]


def _cmd_status(args) -> int:
    from diloco.config import load_config
    from diloco.tools.status import show_status

    config_path, overrides = _split_config(args.config, args.overrides)
    if config_path is not None and Path(config_path).is_dir():
        raise UsageError(
            f"{config_path} is a directory: `diloco status` reads a live run from its peers and takes the "
            f"run's YAML config; `diloco summary {config_path}` shows a run directory from its records"
        )
    overrides = _peer_overrides(overrides, args.peers)
    if args.run_id:
        overrides.append(f"comm.run_id={args.run_id}")
    cfg = load_config(config_path, [*overrides, "comm.hivemind.port=0", "comm.hivemind.client_mode=true"])
    return show_status(cfg.comm, watch=args.watch, timeout_s=args.timeout)


def _local_run_config(args):
    """``diloco local`` / ``testbed``'s config, checked here (with its data) rather than in M workers:
    (cfg, config path, the overrides every worker gets)."""
    from diloco.config import ConfigError
    from diloco.tools.launcher import launch_config
    from diloco.worker.memory import check_local_run_fits

    if args.helpers < 0:
        raise UsageError(f"--helpers={args.helpers} must be at least 0")
    config_path, overrides = _split_config(args.config, args.overrides)
    cfg, overrides = launch_config(config_path, overrides, workers=args.workers, run_dir=args.run_dir)
    check_local_run_fits(cfg, workers=args.workers)
    make_folder(cfg.run_dir, "run.dir", ConfigError)  # a place that cannot hold it: refused before any worker starts
    return cfg, config_path, overrides


def _cmd_local(args) -> int:
    from diloco.tools.launcher import run_local, run_simulated

    cfg, config_path, overrides = _local_run_config(args)
    if args.helpers and cfg.comm.backend != "hivemind":
        raise UsageError(f"helpers join hivemind runs: --helpers needs comm.backend=hivemind, not {cfg.comm.backend}")
    if cfg.comm.backend == "simulator":
        return run_simulated(cfg, workers=args.workers)
    return run_local(cfg, config_path, overrides, workers=args.workers, helpers=args.helpers)


def _cmd_launch(args) -> int:
    from diloco.tools.launch import run_launch

    config_path, overrides = _split_config(args.config, args.overrides)
    if args.join is not None:
        overrides = _peer_overrides(overrides, args.join, "--join")
    join = args.join is not None
    return run_launch(config_path, overrides, args.script, workers=args.workers, run_dir=args.run_dir, join=join)


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
        from diloco.bench import numbers

        nat = numbers(args.nat, int, "--nat") if args.nat else []
        if any(not 0 <= i < args.workers for i in nat):
            raise TestbedError(f"--nat={args.nat}: workers are numbered 0 to {args.workers - 1}")
        testbed = Testbed(args.workers + args.helpers, up_mbit=up, down_mbit=down, nat=nat)  # helpers: the last
    except TestbedError as error:
        raise UsageError(str(error)) from None
    with testbed:
        return run_local(cfg, config_path, overrides, workers=args.workers, helpers=args.helpers, testbed=testbed)


def _cmd_helper(args) -> int:
    from diloco.tools.helper import run_helper

    if not args.wait > 0:
        raise UsageError(f"--wait={args.wait:g}: a helper waits a positive number of seconds for the run's workers")
    config_path, overrides = _split_config(args.config, args.overrides)
    return run_helper(config_path, _peer_overrides(overrides, args.peers), wait_s=args.wait)


def _cmd_bootstrap(args) -> int:
    from diloco.tools.bootstrap import run_bootstrap

    return run_bootstrap(host=args.host, port=args.port)


def _cmd_config(args) -> int:
    from diloco.config import load_config, masked, to_yaml

    config_path, overrides = _split_config(args.config, args.overrides)
    if args.show:
        from diloco.config.reference import reference_markdown

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


def _cmd_summary(args) -> int:
    from diloco.tools.summary import summary_text

    print(summary_text(Path(args.run_dir)))
    return 0


def _cmd_corpus(args) -> int:
    from diloco.tools.corpus import build_corpus, summary_line

    if args.vocab <= 257 or args.vocab > 2**31:
        raise UsageError(f"--vocab={args.vocab} must be above 257 (the 256 bytes and <|endoftext|>)")
    print(summary_line(build_corpus(args.out_dir, vocab_size=args.vocab, max_bytes=args.max_bytes)), flush=True)
    return 0


def _cmd_bench(args) -> int:
    from diloco.bench import run_benchmark

    return run_benchmark(args)


COMMANDS = {
    "train": _cmd_train,
    "status": _cmd_status,
    "local": _cmd_local,
    "launch": _cmd_launch,
    "join": _cmd_join,
    "testbed": _cmd_testbed,
    "helper": _cmd_helper,
    "bootstrap": _cmd_bootstrap,
    "config": _cmd_config,
    "summary": _cmd_summary,
    "plot": _cmd_plot,
    "corpus": _cmd_corpus,
    "bench": _cmd_bench,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse cannot take positionals after options (``--workers 4 inner.lr=1``); collect those
    stray ``KEY=VALUE`` words as overrides, and reject anything else. ``diloco launch``'s words
    after ``--`` are the command it runs, as given (``args.script``)."""
    words = sys.argv[1:] if argv is None else list(argv)
    script = []
    if "--" in words and [word for word in words if not word.startswith("-")][:1] == ["launch"]:
        words, script = words[: words.index("--")], words[words.index("--") + 1 :]
    parser = _parser(words)
    args, extra = parser.parse_known_args(words)
    args.script = script
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _is_out_of_gpu_memory(error: Exception) -> bool:
    torch = sys.modules.get("torch")  # imported only by the commands that use it
    return torch is not None and isinstance(error, torch.cuda.OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("hivemind").setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    os.environ.setdefault("WANDB_SILENT", "true")
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    # a shell starts background jobs with SIGINT ignored, and children inherit that: restore Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        return COMMANDS[args.command](args)
    except UserError as error:  # errors.py: every mistake the user has to fix
        print(f"diloco: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:
        if not _is_out_of_gpu_memory(error):
            raise
        from diloco.worker.memory import out_of_gpu_memory

        print(f"diloco: error: {out_of_gpu_memory()}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as interrupt:
        print("diloco: interrupted" + (f": {interrupt}" if str(interrupt) else ""), file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
