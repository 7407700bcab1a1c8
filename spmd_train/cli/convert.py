"""`spmd-train convert hf DIR --to RUN_DIR` and `spmd-train convert to-hf RUN_DIR --to DIR`."""

from __future__ import annotations

import argparse
import re
import resource
import sys
from pathlib import Path

from spmd_train.config import load_config
from spmd_train.devices import simulate_devices
from spmd_train.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.I)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def add_convert_parser(sub) -> None:
    """Register `convert hf` and `convert to-hf`."""
    convert = sub.add_parser("convert", help="import a Hugging Face checkpoint into a run, or export a run to one",
                             description="Move weights between Hugging Face checkpoints (config.json + safetensors) "
                             "and spmd_train runs.")
    how = convert.add_subparsers(dest="direction", required=True)
    into = how.add_parser("hf", help="import DIR (Llama, Mistral, Qwen2, Qwen3, Mixtral) as step 0 of a run",
                          description="Read DIR/config.json into the model section, stream DIR's safetensors "
                          "tensor by tensor into their shards on the mesh and save them as step 0 of RUN_DIR "
                          "(an Orbax checkpoint; `train` with run.dir=RUN_DIR continues from it).")
    into.add_argument("source", metavar="DIR", help="Hugging Face checkpoint directory")
    into.add_argument("--to", required=True, metavar="RUN_DIR", help="the run directory to create")
    into.add_argument("overrides", nargs="*", metavar="section.key=value",
                      help="config overrides: the mesh (mesh.fsdp=8), dtypes (model.compute_dtype=float32), ...")
    out = how.add_parser("to-hf", help="export a run's latest parameters as a Hugging Face checkpoint",
                         description="Write RUN_DIR's latest parameters to DIR as size-capped safetensors "
                         "shards with an index and config.json, loadable by transformers.")
    out.add_argument("source", metavar="RUN_DIR", help="a run directory (or its checkpoints/STEP)")
    out.add_argument("--to", required=True, metavar="DIR", help="the directory to create (must not hold files)")
    out.add_argument("--dtype", choices=("bfloat16", "float32", "float16"),
                     help="stored dtype (default: the imported checkpoint's, else bfloat16)")
    out.add_argument("--max-shard-size", default="2GiB", metavar="SIZE",
                     help="largest safetensors file, e.g. 5GB or 500MiB (default: 2GiB)")
    out.add_argument("--drop-mtp", action="store_true",
                     help="leave model.mtp's multi-token prediction modules out (families that store them, "
                     "DeepSeek-V3, write them by default; the others always leave them out)")


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1024' -> bytes; ConfigError naming the text otherwise."""
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size={text!r} is not a size (valid: e.g. 5GB, 500MiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def run_convert(args: argparse.Namespace) -> int:
    """The `convert` subcommand; returns the exit code (ConfigError propagates to the CLI's handler)."""
    if args.direction == "hf":
        return _import(Path(args.source), Path(args.to), args.overrides)
    return _export(Path(args.source), Path(args.to), args.dtype, parse_size(args.max_shard_size), args.drop_mtp)


def _import(source: Path, run_dir: Path, overrides: list[str]) -> int:
    from spmd_train.config.hf_config import read_hf_config

    read_hf_config(source)  # a missing directory or config.json is named before anything starts
    if run_dir.exists() and any(run_dir.iterdir()) and not _interrupted_import(run_dir):
        raise ConfigError(f"--to {run_dir} already holds files (valid: a new run directory; nothing was written)")
    cfg = load_config(None, [f"checkpoint.load_from=hf:{source}", f"run.dir={run_dir}", *overrides])
    simulate_devices(cfg.run.simulate_devices)
    from spmd_train.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.init()
        trainer.save()
    finally:
        trainer.close()
    m = cfg.model
    print(f"imported {source} ({m.num_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}"
          + (f", {m.moe.num_experts} experts" if m.moe else "") + f") into {run_dir}/checkpoints/0; "
          f"peak host memory {_peak_rss_gib():.2f} GiB; train on with run.dir={run_dir}")
    return 0


def _interrupted_import(run_dir: Path) -> bool:
    """Whether `run_dir` holds only what an import stopped before its checkpoint was finished leaves (its lock file,
    config.json, a `checkpoints/` without a finished step): a rerun may write there; anything else is kept."""
    if {p.name for p in run_dir.iterdir()} - {".lock", "config.json", "checkpoints"}:
        return False
    checkpoints = run_dir / "checkpoints"
    return not checkpoints.exists() or not any(p.name.isdigit() for p in checkpoints.iterdir())


def _export(source: Path, out: Path, dtype: str | None, max_shard_bytes: int, drop_mtp: bool = False) -> int:
    from spmd_train.train.restore import load_from_source

    run_dir = source.parent.parent if source.name.isdigit() else (
        source.parent if source.name == "checkpoints" else source)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{source} is not a run directory: it has no config.json (valid: a run.dir that "
                          "`train` or `convert hf` wrote)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--to {out} already exists and is not an empty directory (valid: a new directory; "
                          "nothing was written)")
    cfg = load_config(run_dir / "config.json", ["checkpoint.load_from=null"])
    simulate_devices(cfg.run.simulate_devices)
    from spmd_train.hf import export_hf
    from spmd_train.hf.files import SafetensorsDir
    from spmd_train.hf.run import recorded_config, recorded_source
    from spmd_train.train.engine import Engine
    from spmd_train.train.restore import restore_latest

    checkpoints, where, step = load_from_source(source, str(source))
    engine = Engine.build(cfg)
    done, state = restore_latest(engine, cfg, checkpoints, where, same_run=False, only=step)
    base = recorded_config(run_dir)
    if dtype is None:
        origin = recorded_source(run_dir)
        dtype = (SafetensorsDir(origin).dtype() if origin is not None and origin.is_dir()
                 else (base or {}).get("torch_dtype", (base or {}).get("dtype", "bfloat16")))
    result = export_hf(engine, state.params, out, base_config=base, dtype=dtype, max_shard_bytes=max_shard_bytes,
                       drop_mtp=drop_mtp)
    print(f"exported step {done} of {run_dir} to {out}: {result.tensors} tensors, "
          f"{result.total_bytes / 2**30:.2f} GiB in {len(result.files)} file(s), {dtype}")
    mtp = cfg.model.mtp
    if mtp is not None:
        kept = result.mtp_layers
        print(f"wrote the {mtp.depth} multi-token prediction module(s) (model.mtp) as layers {kept[0]}..{kept[-1]}"
              if kept else f"left out the {mtp.depth} multi-token prediction module(s) (model.mtp): the "
              "checkpoint's next-token logits are the trained model's")
    return 0


def _peak_rss_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
