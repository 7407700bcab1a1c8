"""Train a tiny model of one Hugging Face family's shape here, export it, and store its logits for transformers.

The second half of the export check `make_reference.py --check-export` completes: this script needs our environment
(jax), that one the `hf-reference` extra (torch, transformers); neither needs the other. From the repository root::

    python tests/hf_reference/export_trained.py gemma3 /tmp/trained      # trains 20 steps, writes /tmp/trained/hf
    python tests/hf_reference/make_reference.py --check-export /tmp/trained/hf

It trains `configs/tiny.yaml` with the family's switches on 8 simulated CPU devices, exports in float32 with no
imported config.json (the layout a model trained from scratch gets), and writes ``reference.npz`` (``input_ids``
[8, 24] and our ``logits``) beside the exported files.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {
    "gemma3": ["model.qk_norm=true", "model.norm_plus_one=true", "model.sandwich_norms=true",
               "model.scale_embeddings=true", "model.mlp_activation=gelu_tanh", "model.sliding_window=8",
               "model.layer_types=[sliding,full]", "model.rope_local_theta=10000", "model.rope_theta=1e6",
               "model.query_pre_attn_scalar=24", "model.final_logit_softcap=30", "model.tie_embeddings=true"],
    "deepseek_v3": ["model.num_layers=3", "model.num_kv_heads=8", "model.norm_eps=1e-6", "model.mla.kv_lora_rank=16",
                    "model.mla.q_lora_rank=24", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4",
                    "model.mla.v_head_dim=8", "model.moe.first_k_dense=1", "model.moe.num_experts=8",
                    "model.moe.experts_per_token=2", "model.moe.d_ff=32", "model.moe.num_shared_experts=1",
                    "model.moe.router_score=sigmoid", "model.moe.routed_scaling_factor=2.5", "model.moe.n_group=4",
                    "model.moe.topk_group=2", "model.moe.bias_update_rate=0.001", "model.moe.router_aux_weight=0",
                    "model.moe.router_z_weight=0", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                    "model.rope_scaling.original_max_position=16", "model.rope_scaling.mscale=1",
                    "model.rope_scaling.mscale_all_dim=1", "backends.capacity_factor=4.0", "mesh.tensor=1",
                    "mesh.fsdp=2", "mesh.expert=4", "model.mtp.depth=1"],
    "deepseek_v2": ["model.num_layers=3", "model.num_kv_heads=8", "model.norm_eps=1e-6", "model.mla.kv_lora_rank=16",
                    "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
                    "model.moe.first_k_dense=1", "model.moe.num_experts=8", "model.moe.experts_per_token=3",
                    "model.moe.d_ff=32", "model.moe.num_shared_experts=2", "model.moe.norm_topk_prob=false",
                    "model.moe.routed_scaling_factor=2.0", "model.moe.n_group=4", "model.moe.topk_group=2",
                    "model.moe.group_score=max", "model.moe.seq_aux_weight=0.001", "model.moe.router_aux_weight=0",
                    "model.moe.router_z_weight=0", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                    "model.rope_scaling.original_max_position=16", "model.rope_scaling.mscale=0.707",
                    "model.rope_scaling.mscale_all_dim=0.707", "backends.capacity_factor=4.0", "mesh.tensor=1",
                    "mesh.fsdp=2", "mesh.expert=4"],
    "gpt_oss": ["model.qkv_bias=true", "model.attn_output_bias=true", "model.attention_sinks=true",
                "model.sliding_window=8", "model.layer_types=[sliding,full]", "model.head_dim=16", "model.d_ff=32",
                "model.moe.num_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=32",
                "model.moe.router_logit_bias=true", "model.moe.expert_bias=true", "model.moe.swiglu_limit=1.0",
                "model.moe.router_z_weight=0", "backends.capacity_factor=4.0", "mesh.tensor=1", "mesh.fsdp=2",
                "mesh.expert=4"],
    "qwen3_moe": ["model.qk_norm=true", "model.moe.num_experts=8", "model.moe.experts_per_token=4",
                  "model.moe.d_ff=48", "model.moe.router_z_weight=0", "backends.capacity_factor=4.0", "mesh.tensor=1",
                  "mesh.fsdp=2", "mesh.expert=4"],
}
"""Overrides of configs/tiny.yaml that make each family's distinguishing features (capacity for every token)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path, help="a new directory: OUT/run (the run), OUT/hf (the export)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from spmd_train import load_config
    from spmd_train.hf import export_hf
    from spmd_train.sharding.constrain import use_layout
    from spmd_train.train.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "tiny.yaml", [f"run.dir={args.out / 'run'}", f"train.steps={args.steps}",
                                                       "checkpoint.every=0", "model.compute_dtype=float32",
                                                       *SHAPES[args.family]])
    trainer = Trainer(cfg)
    trainer.run()
    engine, params = trainer.engine, trainer.state.params
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 24)).astype(np.int32)

    def forward(params, tokens):
        with use_layout(engine.layout):
            return nnx.merge(engine.graphdef, engine.model_params(params))(tokens)

    with jax.set_mesh(engine.mesh):
        logits = np.asarray(jax.jit(forward)(params, tokens))
    exported = export_hf(engine, params, args.out / "hf", dtype="float32")
    trainer.close()
    np.savez(args.out / "hf" / "reference.npz", input_ids=tokens, logits=logits)
    print(f"exported {exported.tensors} tensors to {args.out / 'hf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
