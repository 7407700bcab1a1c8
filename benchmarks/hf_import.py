"""Host memory of importing a Hugging Face checkpoint: streamed (ours) against reading it whole first.

Makes a Llama-shaped bf16 checkpoint of at least 1 GB (random weights, two safetensors shards with an
index), then imports it onto 8 simulated CPU devices (fsdp 8, fp32 parameters) in a fresh process per
method, and reads each process's peak resident memory (VmHWM, reset after jax and the engine are up):

- streamed: `hf.load_hf_params`, one stored tensor at a time into its shards;
- whole: what a simple converter does: every tensor read into host memory (`safetensors.numpy.load_file`),
  each parameter assembled whole on the host in fp32, then `jax.device_put` into its sharding.

On CPU the devices' buffers are host memory too, so the figure compared is the peak above the baseline
minus the bytes the parameters occupy on the devices: what the method holds besides the result. The
bound stated in docs/hf.md is one stored tensor plus one device's shard of it (plus allocator slack).

Run: `.venv/bin/python benchmarks/hf_import.py` (about a minute; `--no-write` to skip docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 32000}
"""About 540M parameters: 1.08 GB in bf16."""


def make_checkpoint(directory: Path, layers: int) -> None:
    """A random bf16 Llama checkpoint of SHAPE with `layers` layers in two shards with an index (written tensor
    by tensor)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from spmd_train.analysis.plan.shape import ModelShape
    from spmd_train.config.hf_config import family, model_section
    from spmd_train.config.load import model_from_record
    from spmd_train.hf.names import pieces

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
              **SHAPE, "num_hidden_layers": layers}
    model = model_from_record(model_section(config))
    stacked = {g.path: g.shape for g in ModelShape.from_config(model).params}
    rng = np.random.default_rng(0)
    plan = list(pieces(model, family(config)))
    half = len(plan) // 2
    weight_map = {}
    for k, part in enumerate((plan[:half], plan[half:])):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {}
        for p in part:
            shape = p.layout.hf_shape(tuple(stacked[p.path][len(p.index):]))
            tensors[p.hf_name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
            weight_map[p.hf_name] = name
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(method: str, directory: Path) -> dict:
    """In this process: import with `method`, return bytes (peak above baseline, on devices, largest tensor)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import numpy as np

    from spmd_train import load_config
    from spmd_train.hf.files import SafetensorsDir
    from spmd_train.train.engine import Engine

    cfg = load_config(None, [f"checkpoint.load_from=hf:{directory}", "mesh.fsdp=8", "train.global_batch_size=8",
                             "train.seq_len=128"])
    engine = Engine.build(cfg)
    files = SafetensorsDir(directory)
    run = _streamed if method == "streamed" else _whole
    # A first import compiles its small programs (zeros, slot updates) and warms the allocator; the second
    # is measured: what an import holds, not what compiling it costs (about 0.1 GiB, once per process).
    jax.block_until_ready(run(engine, directory))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    params = run(engine, directory)
    jax.block_until_ready(params)
    peak = _status("VmHWM")
    on_devices = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    stored = sum(int(np.prod(s)) * 2 for s in files.shapes.values())
    return {"method": method, "peak_above_base": peak - base, "on_devices": on_devices,
            "largest_tensor": files.largest_bytes(), "stored": stored}


def _streamed(engine, directory: Path):
    from spmd_train.hf import load_hf_params

    return load_hf_params(engine, directory)


def _whole(engine, directory: Path):
    import jax
    import numpy as np
    from flax import traverse_util
    from safetensors.numpy import load_file

    from spmd_train.config.hf_config import family, read_hf_config
    from spmd_train.hf.names import pieces

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    shapes = traverse_util.flatten_dict(engine.param_shapes, sep=".")
    shardings = traverse_util.flatten_dict(engine.state_shardings.params, sep=".")
    host = {path: np.empty(s.shape, s.dtype) for path, s in shapes.items()}
    for p in pieces(engine.cfg.model, family(read_hf_config(directory))):
        target = host[p.path][p.index] if p.index else host[p.path]
        target[...] = p.layout.to_ours(tensors[p.hf_name], target.shape)
    out = {path: jax.device_put(value, shardings[path]) for path, value in host.items()}
    return traverse_util.unflatten_dict(out, sep=".")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", choices=("streamed", "whole"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16],
                        help="checkpoint depths to import (default 8 and 16: what is held must not grow with depth)")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, Path(args.dir))))
        return
    rows = []
    for layers in args.layers:
        with tempfile.TemporaryDirectory(prefix="hf-import-") as tmp:
            make_checkpoint(Path(tmp), layers)
            for method in ("streamed", "whole"):
                out = subprocess.run([sys.executable, __file__, "--measure", method, "--dir", tmp], cwd=ROOT,
                                     capture_output=True, text=True, check=True)
                rows.append({**json.loads(out.stdout.strip().splitlines()[-1]), "layers": layers})
    print(_table(rows))
    if not args.no_write:
        sys.path.insert(0, str(ROOT))
        from benchmarks.report import provenance, update_section

        update_section("hf_import", "Hugging Face import: host memory",
                       provenance("python benchmarks/hf_import.py") + "\n" + _table(rows))


def _table(rows: list[dict]) -> str:
    gib = 2**30
    lines = [f"Llama-shaped bf16 checkpoints ({SHAPE['hidden_size']} wide, vocab {SHAPE['vocab_size']}, largest tensor "
             f"{rows[0]['largest_tensor'] / 2**20:.0f} MiB) imported onto 8 simulated CPU devices (fsdp 8, fp32 "
             "parameters). On CPU the devices' buffers are host memory: 'held besides' is the peak RSS above the "
             "baseline minus the parameters on the devices.", "",
             "| layers | stored GiB | method | peak RSS above baseline GiB | devices' parameters GiB | "
             "held besides GiB | x largest tensor | vs whole |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        whole = next(w for w in rows if w["method"] == "whole" and w["layers"] == r["layers"])
        besides = r["peak_above_base"] - r["on_devices"]
        ref = whole["peak_above_base"] - whole["on_devices"]
        lines.append(f"| {r['layers']} | {r['stored'] / gib:.2f} | {r['method']} | {r['peak_above_base'] / gib:.2f} | "
                     f"{r['on_devices'] / gib:.2f} | {besides / gib:.3f} | {besides / r['largest_tensor']:.2f} | "
                     f"{besides / ref:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
