"""Device and host memory of Llama-3-8B's train step with and without offload.optimizer, compiled for a TPU slice.

Each layout is compiled once through libtpu (the `tpu-aot` extra) by `analysis.step_report.describe`; memory is
`compiled.memory_analysis()`: device peak = arguments + outputs + temporaries - aliased, host = the host arguments
(the offloaded state) and host temporaries. The saving is stated against the optimizer state's bytes per device.

Run: `.venv/bin/python -m benchmarks.offload` (`--layers N` for a shorter stack, `--topology`).
"""

from __future__ import annotations

import argparse
import datetime
import platform

import jax

from spmd_train import load_config
from spmd_train.analysis import describe

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--topology", default="v5p:2x2x2")
    args = parser.parse_args()
    base = ["model.preset=llama3-8b", f"model.num_layers={args.layers}", "mesh.fsdp=8", "mesh.tensor=1", "mesh.data=1",
            "train.global_batch_size=8", "train.seq_len=2048", "parallel.remat=full"]
    rows = {}
    for name, extra in (("on the device", []), ("offload.optimizer=true", ["offload.optimizer=true"])):
        d = describe(load_config(None, [*base, *extra]), topology=args.topology).per_device
        rows[name] = d
        print(f"{name:24s} device peak {d['peak_bytes'] / GIB:6.2f} GiB (arguments {d['argument_bytes'] / GIB:5.2f}, "
              f"temporaries {d['temp_bytes'] / GIB:5.2f}); host arguments {d['host_argument_bytes'] / GIB:5.2f} GiB, "
              f"host temporaries {d['host_temp_bytes'] / GIB:5.2f} GiB", flush=True)
    plain, off = rows["on the device"], rows["offload.optimizer=true"]
    state = plain["opt_state_bytes"]
    saved = plain["peak_bytes"] - off["peak_bytes"]
    print(f"optimizer state {state / GIB:.2f} GiB per device; the device peak falls by {saved / GIB:.2f} GiB "
          f"({saved / state:.0%} of it); {datetime.date.today()}, jax {jax.__version__}, {platform.machine()}")


if __name__ == "__main__":
    main()
