"""Where step metrics go: metrics.jsonl, TensorBoard event files, and the console.

Only process 0 writes. Interactive runs get a progress bar (rich); non-TTY runs a plain
line every `run.log_every` steps.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import jax

from spmd_train.errors import ConfigError

log = logging.getLogger("spmd_train")


class MetricsSink:
    """Appends one JSON object per step to metrics.jsonl and the same scalars to TensorBoard."""

    def __init__(self, run_dir: Path, *, total_steps: int, log_every: int, start_step: int = 0,
                 progress: bool = True):
        self.active = jax.process_index() == 0
        self.total, self.log_every = total_steps, log_every
        self.path = run_dir / "metrics.jsonl"
        self._file = self._tb = self._progress = None
        if not self.active:
            return
        self._file = open(self.path, "a")  # kept open for the run; closed in close()
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=10)
        if progress and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                      TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()

    def write(self, record: dict[str, Any]) -> None:
        """Record one finished step."""
        if not self.active:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):  # bools too: `skipped` as 0/1
                self._tb.add_scalar(f"train/{key}", float(value), record["step"])
        mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "n/a"
        status = (f"loss {record['loss']:.4f}  {record['tokens_per_sec']:,.0f} tok/s  MFU {mfu}")
        if "val_loss" in record:
            status = f"{status}  val_loss {record['val_loss']:.4f}"
        if record.get("skipped_steps"):
            status = f"{status}  skipped {record['skipped_steps']}"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], status=status)
        elif record["step"] % self.log_every == 0 or record["step"] in (1, self.total) or "val_loss" in record:
            log.info("step %d/%d  %s  grad_norm %.3f  lr %.2e", record["step"], self.total, status,
                     record["grad_norm"], record["lr"])

    def note(self, message: str, *args) -> None:
        """A line for the console (process 0 only)."""
        if self.active:
            (self._progress.console.log if self._progress else log.info)(message % args if args else message)

    def close(self) -> None:
        """Flush and close everything."""
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_history(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """Records of metrics.jsonl up to a step, rewriting the file to match (used on resume).

    A last line cut short (the process was killed mid-write) is dropped; the file is replaced
    atomically, so a kill during the rewrite leaves the old file whole.
    """
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for n, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n != len(lines) - 1:
                raise ConfigError(f"{path} line {n + 1} is not a JSON record (only the last line of a killed run "
                                 "can be cut short): repair or move the file aside") from None
    kept = [r for r in records if r["step"] <= upto_step]
    if jax.process_index() == 0 and len(kept) != len(lines):
        write_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def write_atomically(path: Path, text: str) -> None:
    """Replace a file's contents so a reader (or a kill) sees the old file or the new one, never half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
