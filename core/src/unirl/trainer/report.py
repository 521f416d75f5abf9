"""What a run leaves behind for people: metrics.jsonl, the rows sent to the trackers of
``logging.trackers`` (TensorBoard, W&B, MLflow ...), a PNG of the curves, and a progress bar while it runs."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unirl.config import RunConfig
from unirl.fsio import atomic_write
from unirl.trainer.trackers import TrackerSet

CURVES = (("reward", "train reward"), ("eval", "held-out avg@k"), ("kl", "KL to reference (k3)"),
          ("entropy", "entropy"), ("clip_frac", "clip fraction"), ("response_len", "response length"))


METRICS_FILE = "metrics.jsonl"


def rewrite_metrics(run_dir: Path, history: list[dict[str, Any]]) -> Path:
    """Replace ``metrics.jsonl`` atomically (:func:`unirl.fsio.atomic_write`) with ``history``: a resumed
    run cuts the rows of steps logged after its checkpoint, so the file and the checkpoint agree."""
    return atomic_write(run_dir / METRICS_FILE, "".join(json.dumps(row) + "\n" for row in history))


class MetricsWriter:
    """Appends one JSON line per step (flushed, so a crash loses at most the current step) and hands the
    same row to the trackers (:class:`unirl.trainer.trackers.TrackerSet`: a tracker's failure is its own,
    never the run's)."""

    def __init__(self, run_dir: Path, trackers: TrackerSet | None = None, config: RunConfig | None = None):
        for stale in run_dir.glob(f".{METRICS_FILE}.tmp-*"):  # a crash mid-rewrite_metrics
            stale.unlink(missing_ok=True)
        self.path, self.config = run_dir / METRICS_FILE, config
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.trackers = trackers

    def write(self, metrics: dict[str, Any]) -> None:
        """One line; a failed write (disk full) is :mod:`unirl.trainer.write_errors`' to report: the
        history still holds the row, so the next checkpoint keeps it either way."""
        from unirl.trainer.write_errors import guarded_write

        line = json.dumps(metrics) + "\n"

        def append() -> None:
            self.file.write(line)
            self.file.flush()

        on_error = self.config.run.on_save_error if self.config is not None else "fail"
        guarded_write(append, on_error=on_error, path=self.path, what="metrics", needed=len(line.encode()), kept="earlier rows are kept")
        if self.trackers is not None:
            self.trackers.log(metrics)

    def log_artifact(self, path: Path) -> None:
        if self.trackers is not None:
            self.trackers.log_artifact(path)

    def close(self) -> None:
        """Idempotent: a stop (failure guard, preemption) closes before the end of the loop does. The last
        rows' flush may meet a full disk: the same rule as a row's write."""
        from unirl.trainer.write_errors import guarded_write

        on_error = self.config.run.on_save_error if self.config is not None else "fail"
        try:
            guarded_write(self.file.close, on_error=on_error, path=self.path, what="metrics", needed=None,
                          kept="earlier rows are kept")
        finally:
            self._close_trackers()

    def _close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close()


def plot_curves(history: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = curves_figure(history)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def curves_figure(history: list[dict[str, Any]]) -> Any:
    """The figure :func:`plot_curves` saves (a matplotlib ``Figure``; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, CURVES, strict=True):
        if key == "kl" and not any("kl" in h for h in history):  # no reference: show KL(old || new)
            key, title = "approx_kl", "KL(pi_old || pi), no reference"
        pts = [(h["step"], h[key]) for h in history if key in h and h[key] is not None and math.isfinite(h[key])]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if key == "eval" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "reward":  # a failed sample scores nothing: without this, all-failed looks like all-wrong
            failed = [(h["step"], h["failed_frac"]) for h in history if isinstance(h.get("failed_frac"), int | float)]
            if failed:
                twin = ax.twinx()
                xs, ys = zip(*failed, strict=True)
                twin.plot(xs, ys, color="tab:red", linestyle="--", label="failed fraction")
                twin.set_ylim(-0.02, 1.02)
                twin.set_ylabel("failed fraction", color="tab:red")
                ax.set_title("train reward (red: failed fraction)")
    fig.tight_layout()
    return fig


def step_status(metrics: dict[str, Any]) -> str:
    """The bar's text after an RL step: reward, the failed fraction when any sample failed, eval."""
    text = f"reward {metrics['reward']:.3f}"
    if metrics.get("failed_frac"):
        text += f" [red]failed {metrics['failed_frac']:.0%}[/]"
    if "eval" in metrics:
        text += f" eval {metrics['eval']:.3f}"
    return text


@contextlib.contextmanager
def progress_bar(config: RunConfig, label: str, total: int, start: int = 0) -> Iterator[Callable[[int, str], None]]:
    """A rich bar with step, a status text (reward), elapsed time and ETA; a no-op when trainer.progress
    is off."""
    if not config.trainer.progress or total == 0:
        yield lambda done, text: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
                  TimeRemainingColumn()) as progress:
        task = progress.add_task(label, total=total, completed=start, status="")
        yield lambda done, text: progress.update(task, completed=done, status=text)


def say(config: RunConfig, text: str) -> None:
    """One line of what the run does (``unirl ...``), when ``trainer.progress`` is on."""
    if config.trainer.progress:
        from rich.console import Console

        Console(soft_wrap=True).print(f"[bold cyan]unirl[/] {text}")


def report_memory(memory: Any, run_dir: Path, config: RunConfig) -> None:
    """Each phase's peak memory over the run: ``RUN_DIR/memory.json`` and :func:`memory_table`; a full disk
    follows ``run.on_save_error`` (the run has finished: nothing else depends on this file)."""
    from unirl.trainer.write_errors import guarded_write

    if memory is None or not memory.table:
        return
    path = guarded_write(lambda: memory.write(run_dir), on_error=config.run.on_save_error,
                         path=run_dir / "memory.json", what="memory report", needed=None,
                         kept="metrics.jsonl and the checkpoints are intact")
    if path is not None:
        say(config, f"peak memory per phase (MiB; {path.name}):\n" + memory_table(memory))


def memory_table(memory: Any) -> str:
    """Each phase's peak RSS (MiB) over the run, one row per phase: the trainer's process, each rank's
    and their sum (``memory``: a :class:`unirl.trainer.memory.MemoryRecorder`); a CUDA column set when
    a GPU was used. How RSS was measured (the kernel's high-water mark, or sampling) closes the table."""
    table = memory.table
    ranks = max((len(p.ranks_rss_mb) for p in table.values()), default=0)
    cuda = any(p.cuda_mb is not None or any(c is not None for c in p.ranks_cuda_mb) for p in table.values())
    head = ["phase", "trainer", *(f"rank{k}" for k in range(ranks)), *(["ranks sum"] if ranks else [])]
    if cuda:
        head += ["cuda trainer", *(f"cuda rank{k}" for k in range(ranks))]
    rows = [head]
    for name, p in table.items():
        row = [name, f"{p.rss_mb:.0f}", *(f"{r:.0f}" for r in p.ranks_rss_mb),
               *([""] * (ranks - len(p.ranks_rss_mb))), *([f"{sum(p.ranks_rss_mb):.0f}"] if ranks else [])]
        if cuda:
            cells = [p.cuda_mb, *p.ranks_cuda_mb, *([None] * (ranks - len(p.ranks_cuda_mb)))]
            row += ["" if c is None else f"{c:.0f}" for c in cells]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    how = "kernel high-water mark (VmHWM)" if memory.meter.method == "hwm" else "RSS sampled every 10 ms"
    ranks_note = "; rank columns: the actor's own processes (FSDP ranks)" if ranks else ""
    return "\n".join(lines) + f"\n(RSS: {how}{ranks_note})"
