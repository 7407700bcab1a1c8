"""The optional Weights & Biases mirror of metrics.jsonl (`run.wandb=true`, the `wandb` extra).

One W&B run per run.dir: its id is kept in run.dir/wandb_id, so a resumed run appends to the
same W&B run instead of starting a new one. `run.wandb_mode=offline` (or WANDB_MODE=offline)
writes to run.dir/wandb only, for `wandb sync` later, and needs no network.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

from spmd_train.config.run_schema import RunConfig
from spmd_train.errors import ConfigError


def require_wandb() -> Any:
    """The wandb module; ConfigError naming the extra where it is not installed (checked before anything compiles)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("run.wandb=true needs the wandb package (valid: pip install 'spmd_train[wandb]', "
                          "or run.wandb=false)") from None
    return wandb


class WandbRun:
    """A W&B run that receives every step record (process 0 only; the caller decides)."""

    def __init__(self, run: RunConfig, run_dir: Path, config: dict[str, Any]):
        wandb = require_wandb()
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        try:
            self._run = wandb.init(project=run.wandb_project, dir=str(run_dir), id=run_id, resume="allow",
                                   config=config, mode=run.wandb_mode, name=run_dir.name, reinit="create_new")
        except Exception as err:  # no network online, no API key: W&B's own reason, without its traceback
            raise ConfigError(f"run.wandb=true: Weights & Biases could not start a run ({type(err).__name__}: "
                              f"{str(err)[:300]}); without a network use run.wandb_mode=offline") from None
        id_file.write_text(run_id)

    def log(self, record: dict[str, Any], histograms: dict[str, Any] | None = None) -> None:
        """Send one step's scalars (non-finite ones too: W&B charts NaN as gaps) and any histograms (name -> rows,
        one W&B histogram per row, as `MetricsSink.write` takes them)."""
        values = {f"train/{k}": float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not (isinstance(v, float) and math.isinf(v))}
        if histograms:
            wandb = require_wandb()
            values |= {f"train/{name}.{i}": wandb.Histogram(row) for name, rows in histograms.items()
                       for i, row in enumerate(rows)}
        # Committed now: with an explicit step W&B otherwise holds a step's row until the next step or finish(),
        # and the last row of a run was missing from the offline file in one CI run (test_metrics_sinks).
        self._run.log(values, step=record["step"], commit=True)

    def close(self) -> None:
        """Finish the W&B run (uploads what is left when online)."""
        self._run.finish()
