"""Where step metrics go: metrics.jsonl, TensorBoard event files, Weights & Biases, and the console.

Only process 0 writes. Terminals and notebooks get a progress bar (rich; in Jupyter through
ipywidgets); other runs a plain line every `run.log_every` steps. metrics.jsonl stays strict
JSON: a non-finite value is written as null and its key listed under `nonfinite`.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console

from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.train.guards import REASONS

log = logging.getLogger("spmd_train")
_WRITERS = itertools.count()


class MetricsSink:
    """Appends one JSON object per step to metrics.jsonl and the same (finite) scalars to TensorBoard."""

    def __init__(self, run_dir: Path, *, total_steps: int, log_every: int, start_step: int = 0,
                 progress: bool = True, mirrors: tuple[Any, ...] = ()):
        self.active = jax.process_index() == 0
        self.total, self.log_every = total_steps, log_every
        self.path = run_dir / "metrics.jsonl"
        self.mirrors = mirrors  # more destinations with a `log(record)` (the W&B run)
        self._file = self._tb = self._progress = None
        if not self.active:
            return
        self._file = open(self.path, "a")  # kept open for the run; closed in close()
        from tensorboardX import SummaryWriter

        # A resumed run repeats the steps after its checkpoint: TensorBoard hides the earlier events from the first
        # repeated step on (a SessionLog START at `purge_step`), so a chart has each step once, from this run.
        # Each writer its own file: tensorboardX names files by the second, and a second writer within the same
        # second (a resume, step() then run()) truncated the first one's file. TensorBoard reads a directory's files
        # in name order, so within a second they sort by the step they start from.
        suffix = f".{start_step:012d}.{os.getpid()}.{next(_WRITERS)}"
        self._tb = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=10,
                                 purge_step=start_step + 1 if start_step else None, filename_suffix=suffix)
        console = Console(stderr=True)
        if progress and (console.is_interactive or console.is_jupyter):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                      TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False,
                                      console=console)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()

    def write(self, record: dict[str, Any], histograms: dict[str, np.ndarray] | None = None) -> None:
        """Record one finished step; `histograms` (name -> [rows, values], the MoE layers' per-expert vectors) go to
        TensorBoard and the mirrors as one histogram per row on the steps the console logs (every run.log_every)."""
        if not self.active:
            return
        self._file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        self._file.flush()
        step = record["step"]
        for key, value in record.items():
            # Bools too (`skipped` as 0/1); not a NaN or Inf, which a chart cannot place (metrics.jsonl lists them).
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"train/{key}", float(value), step)
        if not self._logs(step):
            histograms = None
        for name, rows in (histograms or {}).items():
            for i, row in enumerate(rows):
                if np.isfinite(row).all():
                    self._tb.add_histogram(f"train/{name}.{i}", row, step)
        for mirror in self.mirrors:
            mirror.log(record, histograms)
        mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "n/a"
        status = (f"loss {record['loss']:.4f}  {record['tokens_per_sec']:,.0f} tok/s  MFU {mfu}")
        if "mtp_loss" in record:
            status = f"{status}  mtp_loss {record['mtp_loss']:.4f}"
        if "val_loss" in record:
            status = f"{status}  val_loss {record['val_loss']:.4f}"
        if record.get("skipped_steps"):
            status = f"{status}  skipped {record['skipped_steps']}"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], status=status)
        elif self._logs(step) or "val_loss" in record:
            log.info("step %d/%d  %s  grad_norm %.3f  lr %.2e", record["step"], self.total, status,
                     record["grad_norm"], record["lr"])

    def _logs(self, step: int) -> bool:
        """Whether `step` is one the console logs (and histograms are written for)."""
        return step % self.log_every == 0 or step in (1, self.total)

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


def step_record(index: int, metrics: dict[str, Any], *, seconds: float, data_wait: float, cfg: Config,
                mesh: jax.sharding.Mesh, flops_per_token: float, peak_flops: float | None,
                loss_floor: float | None) -> dict[str, Any]:
    """The record of step `index` + 1 (what metrics.jsonl holds) from the step's metrics, already on the host (the
    caller fetches them: that wait is part of its timing), and its timing."""
    values = {k: float(v) for k, v in metrics.items()}
    reason = REASONS[int(values.pop("skip_reason"))]
    values.update(skipped=reason is not None, skip_reason=reason, skipped_steps=int(values["skipped_steps"]),
                  consecutive_skips=int(values["consecutive_skips"]))
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    per_device = tokens / seconds / mesh.size
    return {
        "step": index + 1,
        **values,
        "step_time_s": seconds,
        "data_wait_s": data_wait,
        "tokens_per_sec": tokens / seconds,
        "tokens_per_sec_per_device": per_device,
        "mfu": per_device * flops_per_token / peak_flops if peak_flops else None,
        "memory_bytes": memory_in_use(mesh),
        "loss_floor": loss_floor,
    }


def memory_in_use(mesh: jax.sharding.Mesh) -> int | None:
    """The most bytes in use on any of this process's devices, where the backend reports it (not on CPU)."""
    stats = [d.memory_stats() for d in mesh.local_devices]
    used = [s.get("bytes_in_use") for s in stats if s]
    return int(np.max(used)) if used and None not in used else None


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """The record with each non-finite float as None, their keys listed under `nonfinite` (JSON has no NaN)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}


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
