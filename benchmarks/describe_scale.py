"""How long `describe` takes to plan big TPU slices from this CPU host, and what it finds.

Usage: python benchmarks/describe_scale.py [--case NAME ...]
Each case compiles one train step for a TPU slice through libtpu (the tpu-aot extra) and
reports the wall time of the whole `describe` call beside the per-chip memory it found.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import provenance, update_section  # noqa: E402
from spmd_train import load_config  # noqa: E402
from spmd_train.analysis import describe  # noqa: E402
from spmd_train.units import human_bytes  # noqa: E402

CASES = {
    "llama3-8b on v5p:8x8x8 (512 chips), fsdp 64 x tensor 8": ("configs/llama3-8b_v5p-512.yaml", "v5p:8x8x8", []),
    "llama-1b on v6e:16x16 (256 chips), fsdp 256, full remat": (
        None, "v6e:16x16",
        ["model.preset=llama-1b", "mesh.preset=fsdp", "parallel.remat=full", "train.global_batch_size=256",
         "train.seq_len=4096"],
    ),
    "llama-1b on v6e:16x16 (256 chips), fsdp 256, no remat": (
        None, "v6e:16x16",
        ["model.preset=llama-1b", "mesh.preset=fsdp", "train.global_batch_size=256", "train.seq_len=4096"],
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES), help="default: all")
    args = parser.parse_args()
    rows = ["| case | describe wall time (s) | of which compile (s) | peak memory per chip | HBM per chip | fits |",
            "|---|---:|---:|---:|---:|---|"]
    for name in args.case or list(CASES):
        path, topology, overrides = CASES[name]
        start = time.perf_counter()
        report = describe(load_config(ROOT / path if path else None, overrides), topology=topology)
        wall = time.perf_counter() - start
        rows.append(f"| {name} | {wall:.1f} | {report.compile_seconds:.1f} | "
                    f"{human_bytes(report.per_device['peak_bytes'])} | {human_bytes(report.hbm_bytes)} | "
                    f"{'yes' if report.fits else 'no: ' + ' '.join(report.notes)} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    body = (provenance("python benchmarks/describe_scale.py " + " ".join(sys.argv[1:])).replace(
        "- hardware:", "- host (compiles for the TPU slice through libtpu):")
        + "\n" + table + "\n\nTarget: well under 60 s for 512 chips on this 2-core host. Peak = argument + "
        "output + temp - alias from the TPU compiler's memory analysis.\n")
    update_section("describe_scale", "Planning TPU slices from a CPU host (`benchmarks/describe_scale.py`)", body)


if __name__ == "__main__":
    main()
