"""``diloco plot RUN_DIR ... --out FILE.png``: validation loss against tokens, wall time and bytes.

Reads the round records of each run directory (worker 0's, since every worker holds the same
global params) and draws one line per run, labelled with the run directory's name. Tokens are
counted over all workers; bytes are what one worker sent; wall time is the worker's training
time at the record (a resumed run's includes its time before).
"""

from __future__ import annotations

import json
from pathlib import Path

from diloco.errors import PlotError, make_folder


def pyplot():
    """matplotlib's pyplot, drawing to files; ``PlotError`` when the optional extra is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plots need matplotlib, an optional extra: pip install 'diloco[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_curve(run_dir: Path) -> dict:
    """The validation curve of one run: tokens (all workers), seconds, bytes sent (one worker), loss."""
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("worker-*.jsonl"))
    if not files:
        raise PlotError(f"{run_dir} has no worker-*.jsonl records (is it a run directory?)")
    records = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    if not any(r.get("event") == "round" for r in records):
        raise PlotError(f"{run_dir} has no round records yet")
    workers = len(files)
    sent, seconds, curve = 0, 0.0, {"name": run_dir.name, "tokens": [], "seconds": [], "bytes": [], "val_loss": []}
    for record in records:
        if record.get("event") == "step":  # a round record from before they carried the time: its last step's
            seconds = record["time_s"]
        if record.get("event") != "round":
            continue
        sent += record["bytes_sent"]
        curve["tokens"].append(record["tokens"] * workers)
        curve["seconds"].append(record.get("time_s", seconds))
        curve["bytes"].append(sent)
        curve["val_loss"].append(record["val_loss"])
    return curve


def plot_curves(curves: list[dict], out: Path, *, axes: tuple[str, ...] = ("tokens", "seconds", "bytes")) -> Path:
    """Draw ``curves`` side by side, one panel per x axis, and save a PNG."""
    plt = pyplot()
    figure = draw_curves(curves, axes)
    out = Path(out)
    try:
        make_folder(out.parent, "--out", PlotError, shown=out)
        figure.savefig(out, dpi=110)
    except OSError as error:
        raise PlotError(
            f"--out={out} cannot be written ({error.strerror}): point --out at a place you can write"
        ) from None
    finally:
        plt.close(figure)
    return out


def draw_curves(curves: list[dict], axes: tuple[str, ...] = ("tokens", "seconds", "bytes")):
    """The figure of ``plot_curves``: one panel per x axis, a line per curve in each."""
    plt = pyplot()
    titles = {"tokens": "tokens (all workers)", "seconds": "wall time (s)", "bytes": "bytes sent per worker"}
    figure, panels = plt.subplots(1, len(axes), figsize=(5.5 * len(axes), 4.2), squeeze=False)
    for panel, axis in zip(panels[0], axes):
        for curve in curves:
            xs = curve[axis]
            if axis == "bytes":
                xs = [max(x, 1) for x in xs]  # a single worker sends nothing: keep it on the log axis
            panel.plot(xs, curve["val_loss"], label=curve["name"], linewidth=1.3)
        panel.set_xlabel(titles[axis])
        panel.set_ylabel("validation loss (nats/token)")
        if axis == "bytes":
            panel.set_xscale("log")
        panel.grid(alpha=0.3)
    panels[0][0].legend(fontsize=7)
    figure.tight_layout()
    return figure
