"""Device and host memory of Llama-3-8B's train step with and without host offload, compiled for a TPU slice.

Four layouts: full remat with the state on the device, the same with offload.optimizer=true, that with
offload.params=true too (the layer stack's parameters in host memory, fetched a layer at a time), and
parallel.remat=offload_layer_inputs (each layer's input in host memory, against full remat).

Each layout is compiled once through libtpu (the `tpu-aot` extra) by `analysis.step_report.describe`. Three device
figures, as three parts of XLA see them: `compiled.memory_analysis()`'s peak (arguments + outputs + temporaries -
aliased: what `describe` reports), the heap buffer assignment gives the device's default memory space (every buffer
at its offset: what the runtime allocates), and the peak of XLA's live-range analysis less the host memory space's
bytes (what is live at once). Host: the host arguments (the offloaded state) and host temporaries. Savings are stated
against the optimizer state's bytes per device.

Run: `.venv/bin/python -m benchmarks.offload` (`--layers N` for a shorter stack, `--topology`).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import platform
import re
import tempfile

DUMP = tempfile.mkdtemp(prefix="offload-bench-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} "
                           "--xla_dump_hlo_module_re=step_fn").strip()  # before jax reads it

import jax  # noqa: E402

from benchmarks.plan_accuracy import live_peak  # noqa: E402
from spmd_train import load_config  # noqa: E402
from spmd_train.analysis import describe  # noqa: E402

GIB = 2**30


def _dumped(seen: set[str], live_seen: set[str]) -> tuple[float, float]:
    """(heap, live peak) in bytes of the step program dumped since `seen` / `live_seen`: the default memory space's
    total in the memory-usage report, and the live-range peak (`plan_accuracy.live_peak`, the host's memory space
    left out)."""
    new = sorted(set(glob.glob(os.path.join(DUMP, "*step_fn*memory-usage-report.txt"))) - seen)
    report = open(new[-1]).read()
    spaces = dict(re.findall(r"Memory Space: (\S+) \(color=\d+\)\nTotal bytes: (\d+)", report))
    return float(spaces["default"]), live_peak(DUMP, live_seen, "tpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--topology", default="v5p:2x2x2")
    args = parser.parse_args()
    base = ["model.preset=llama3-8b", f"model.num_layers={args.layers}", "mesh.fsdp=8", "mesh.tensor=1", "mesh.data=1",
            "train.global_batch_size=8", "train.seq_len=2048", "parallel.remat=full"]
    rows, live_seen = {}, set()
    for name, extra in (("on the device", []), ("offload.optimizer=true", ["offload.optimizer=true"]),
                        ("offload.params=true too", ["offload.optimizer=true", "offload.params=true"]),
                        ("remat=offload_layer_inputs", ["parallel.remat=offload_layer_inputs"])):
        seen = set(glob.glob(os.path.join(DUMP, "*step_fn*memory-usage-report.txt")))
        d = dict(describe(load_config(None, [*base, *extra]), topology=args.topology).per_device)
        d["heap"], d["live"] = _dumped(seen, live_seen)
        rows[name] = d
        print(f"{name:24s} peak {d['peak_bytes'] / GIB:6.2f} GiB (arguments {d['argument_bytes'] / GIB:5.2f}, "
              f"temporaries {d['temp_bytes'] / GIB:5.2f}), heap {d['heap'] / GIB:6.2f} GiB, "
              f"live {d['live'] / GIB:6.2f} GiB; host arguments {d['host_argument_bytes'] / GIB:5.2f} GiB, "
              f"host temporaries {d['host_temp_bytes'] / GIB:5.2f} GiB", flush=True)
    plain, off = rows["on the device"], rows["offload.optimizer=true"]
    state = plain["opt_state_bytes"]
    for what, key in (("memory_analysis peak", "peak_bytes"), ("heap", "heap"), ("live peak", "live")):
        saved = plain[key] - off[key]
        print(f"{what}: falls by {saved / GIB:.2f} GiB, {saved / state:.0%} of the optimizer state's "
              f"{state / GIB:.2f} GiB per device")
    params = rows["offload.params=true too"]
    stack = params["host_argument_bytes"] - off["host_argument_bytes"]
    # The live-range peak counts host temporaries with the device's buffers: with gradients passing through the
    # host it is not the device's, so only the other two figures are compared.
    for what, key in (("memory_analysis peak", "peak_bytes"), ("heap", "heap")):
        saved = off[key] - params[key]
        print(f"parameters offloaded too: {what} falls by {saved / GIB:.2f} GiB more, {saved / stack:.0%} of the "
              f"layer stack's {stack / GIB:.2f} GiB per device; host temporaries "
              f"{params['host_temp_bytes'] / GIB:.2f} GiB")
    inputs = rows["remat=offload_layer_inputs"]
    print(f"layer inputs offloaded: {inputs['host_temp_bytes'] / GIB:.2f} GiB of host temporaries; device "
          f"temporaries {plain['temp_bytes'] / GIB:.2f} -> {inputs['temp_bytes'] / GIB:.2f} GiB")
    print(f"{datetime.date.today()}, jax {jax.__version__}, {platform.machine()}")


if __name__ == "__main__":
    main()
