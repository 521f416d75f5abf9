"""The end of a run: the final eval's line, the trace, the curves and the exported model (``unirl
train``), or the warm-started model (``unirl sft``); and the writer closed whatever happened."""

from __future__ import annotations

import math
import time

from unirl.trainer.phases import phase
from unirl.trainer.report import MetricsWriter, plot_curves, report_memory
from unirl.trainer.run import Run, TrainResult, export_model
from unirl.trainer.write_errors import guarded_write


def close_run(run: Run, result: TrainResult, end: int, writer: MetricsWriter) -> None:
    """The run's end (:func:`finish`: final eval, plot, export), the plot to the trackers, and the
    writer closed (metrics flushed, trackers closed) whatever happened in between."""
    try:
        finish(run, result, end)
        if result.plot:
            writer.log_artifact(result.plot)
    finally:
        writer.close()


def curves_so_far(run: Run, writer: MetricsWriter, result: TrainResult) -> None:
    """Before a stop (trainer.max_failed_frac): the metrics flushed and the curves so far plotted."""
    writer.close()
    if run.config.trainer.plot:
        plot_curves(result.history, run.run_dir / "curves.png")


def finish(run: Run, result: TrainResult, end: int) -> TrainResult:
    """The trace, the curves and the exported model of a finished run, and the lines that say where."""
    c, t = run.c, run.config.trainer
    trace, run.tracer_closed = c.tracer.close(), True
    if trace:
        run.say(f"rollout trace: {trace}")
    result.steps_done = end
    evals = [h["eval"] for h in result.history if "eval" in h and h["step"] > 0]
    result.eval_after = evals[-1] if evals and end == t.steps else math.nan
    on_error = run.config.run.on_save_error  # a full disk at the end: one line (fail) or a warning (warn)
    if t.plot:
        result.plot = guarded_write(lambda: plot_curves(result.history, run.run_dir / "curves.png"),
                                    on_error=on_error, path=run.run_dir / "curves.png", what="curves", needed=None,
                                    kept="metrics.jsonl and the checkpoints are intact")
    if end == t.steps and t.export_hf and t.steps > 0:  # a failed write keeps the checkpoints (export them later)
        with phase("export", {}):  # after the last row: its peaks are in memory.json and the closing table
            guarded_write(lambda: export_model(c, run.run_dir / "hf"), on_error=on_error,
                          path=run.run_dir / "hf", what="export", needed=None,
                          kept="the checkpoints are intact (`unirl export RUN_DIR` writes it later)")
    if t.steps == 0:  # nothing trained, nothing saved: say what ran and where evaluation lives
        run.say(f"trainer.steps=0: no RL step ran; held-out avg@{t.eval_k} of this model: "
                f"{result.eval_before:.3f}. To evaluate a model: unirl eval RECIPE model.path=DIR")
    elif end == t.steps:
        minutes, seconds = divmod(int(time.perf_counter() - run.t_start), 60)
        run.say(f"held-out avg@{t.eval_k}: {result.eval_before:.3f} -> {result.eval_after:.3f} "
                f"({minutes}m{seconds:02d}s)")
        if result.plot:
            run.say(f"curves: {result.plot}")
        run.say(f"run directory: {run.run_dir} (metrics.jsonl, checkpoints/"
                + (", hf/: the trained model for transformers or vLLM)" if t.export_hf else ")"))
    report_memory(run.memory, run.run_dir, run.config)
    return result


def finish_warm_start(run: Run, result: TrainResult) -> TrainResult:
    """``unirl sft``: the warm-started model as an HF directory, the memory report, where it is."""
    with phase("export", {}):
        export_model(run.c, run.run_dir / "hf")
    report_memory(run.memory, run.run_dir, run.config)
    run.say(f"warm-started model: {run.run_dir / 'hf'} (transformers / vLLM load it; model.path= uses it)")
    return result
