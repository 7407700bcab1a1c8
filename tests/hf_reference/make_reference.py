"""Make the committed Hugging Face reference fixtures under ``tests/hf_reference/<family>/``.

For each tiny model family (llama, llama32, mistral, mistral_window, qwen2, qwen3, mixtral, qwen3_moe, qwen3_yarn,
gemma3, deepseek_v3, gpt_oss,
gpt_oss_mxfp4, deepseek_v2)
this script builds a randomly initialised ``transformers`` model in float32, re-initialises every parameter with
large-ish values (so that interop tests are sensitive to any layout or math mistake), and writes:

* ``config.json`` (+ ``generation_config.json``) and the weights, exactly as
  ``save_pretrained(..., safe_serialization=True)`` writes them (``model.safetensors``; qwen2 is
  saved sharded with ``model.safetensors.index.json``). The llama config is afterwards rewritten
  into the legacy layout (top-level ``rope_theta`` / ``rope_scaling``, ``torch_dtype``) that most
  published Llama 3.1 checkpoints use, and the script asserts transformers still loads it to the
  same logits.
* ``reference.npz``: ``input_ids`` int32 [8, 24], ``logits`` float32 [8, 24, vocab] (fp32, eval,
  no_grad), and ``prompt_{0,1}`` / ``greedy_{0,1}`` int32 1-D (greedy ``generate`` of exactly 12
  new tokens; ``greedy_k`` is the full sequence prompt + new tokens).

It needs the ``hf-reference`` extra (torch, transformers, safetensors, numpy); it does not import
spmd_train or jax. The output is deterministic (``torch.manual_seed`` per family). Run from the
repository root::

    python tests/hf_reference/make_reference.py                 # regenerate every family
    python tests/hf_reference/make_reference.py --only llama    # just some families
    python tests/hf_reference/make_reference.py --check-export DIR

``--check-export DIR`` loads DIR with ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)``,
runs it on ``input_ids`` from ``DIR/reference.npz`` and compares with the ``logits`` stored there
(e.g. written by our exporter); it exits non-zero when max|diff| / max|ref| exceeds 1e-4.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Mxfp4Config,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HERE = Path(__file__).resolve().parent
VOCAB = 256
BATCH, SEQ = 8, 24
PROMPT_LENS = (5, 9)
NEW_TOKENS = 12
CHECK_RTOL = 1e-4

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def make_config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON, rope_parameters=llama3_rope(8.0), tie_word_embeddings=False)
    if family == "llama32":
        return LlamaConfig(**COMMON, rope_parameters=llama3_rope(32.0), tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(
            **COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            sliding_window=None,
            tie_word_embeddings=False,
        )
    if family == "mistral_window":
        # Mistral's sliding window at 7 of the 24 positions, so most queries lose keys to it.
        return MistralConfig(
            **COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            sliding_window=7,
            tie_word_embeddings=False,
        )
    if family == "qwen2":
        return Qwen2Config(
            **COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
        )
    if family == "qwen3":
        return Qwen3Config(
            **COMMON,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
        )
    if family == "qwen3_yarn":
        # Qwen3 with YaRN stretching a 6-position original context by 4 (the ramp spans most of head_dim 32's
        # pairs at this length; attention factor 1 + 0.1 ln 4 on cos and sin), as Qwen's long-context configs do.
        return Qwen3Config(
            **dict(COMMON, max_position_embeddings=24),  # 6 x 4: the factor the two lengths imply
            head_dim=32,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 6, "beta_fast": 32.0, "beta_slow": 1.0},
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
        )
    if family == "mixtral":
        common = dict(COMMON, intermediate_size=96)
        return MixtralConfig(
            **common,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            sliding_window=None,
            tie_word_embeddings=False,
            router_jitter_noise=0.0,
        )
    if family == "qwen3_moe":
        # Fine-grained: 8 experts of width 48, top-4, gates not renormalised (transformers' default; the
        # published checkpoints renormalise, so reading the field is what the logits check), Q/K norms, head_dim 32.
        return Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if family == "gemma3":
        # Gemma 3's text model with everything it has on at once: (1 + w) and sandwich norms, scaled embeddings, GeGLU,
        # Q/K norms, a query scale of 24 (not head_dim 32), a sliding layer (window 7, RoPE base 1e4) then a full one
        # (base 1e6, linearly scaled by 2), and the output logits soft-capped at 10. Not the attention soft-cap:
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it.
        return Gemma3TextConfig(
            **{k: v for k, v in COMMON.items() if k != "hidden_act"},
            head_dim=32,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=7,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            attn_logit_softcapping=None,
            final_logit_softcapping=10.0,
            tie_word_embeddings=True,
            attention_bias=False,
        )
    if family == "deepseek_v3":
        # DeepSeek-V3's layout at 3 layers: MLA (query latent 48, key/value latent 32, nope 16 + rope 8 per head,
        # values 16; rotary pairs interleaved on disk), layer 0 dense, then 8 sigmoid-routed experts of width 32 in 4
        # groups, top-2 from the best 2 groups, gates renormalised and scaled by 2.5, one shared expert, a selection
        # bias (e_score_correction_bias, drawn N(0, 0.1)), and YaRN (factor 4 over 6 positions, mscale =
        # mscale_all_dim = 1: the tables' factor is 1, the softmax scale is multiplied by (1 + 0.1 ln 4)^2).
        return DeepseekV3Config(
            **dict(COMMON, num_hidden_layers=3, num_key_value_heads=8, max_position_embeddings=24),
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            num_nextn_predict_layers=0,  # no MTP layers: tests add one to show import leaves it unread
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 6, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0},
            tie_word_embeddings=False,
            attention_bias=False,
        )
    if family == "deepseek_v2":
        # DeepSeek-V2's layout at 3 layers: MLA without a query latent (V2-Lite's q_proj; key/value latent 32, nope 16
        # + rope 8 per head, values 16; rotary pairs interleaved), layer 0 dense, then 8 softmax-routed experts of
        # width 32 in 4 groups, top-3 from the 2 groups with the best single score (group_limited_greedy), gates not
        # renormalised and scaled by 2, two shared experts, and V2-Lite's YaRN (mscale = mscale_all_dim = 0.707,
        # factor 4 over 6 positions: the tables' factor is 1, the softmax scale is multiplied by (1 + 0.0707 ln 4)^2).
        return DeepseekV2Config(
            **dict(COMMON, num_hidden_layers=3, num_key_value_heads=8, max_position_embeddings=24),
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            norm_topk_prob=False,
            routed_scaling_factor=2.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 6, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.707, "mscale_all_dim": 0.707},
            tie_word_embeddings=False,
            attention_bias=False,
        )
    if family in ("gpt_oss", "gpt_oss_mxfp4"):
        # gpt-oss at 2 layers: a sliding layer (window 7) then a full one, Q/K/V and output biases, a sink logit per
        # head, YaRN (factor 4 over 6 positions, theta 150000, ramp ends unrounded), 4 experts of width 32 with biases
        # and the clamped SwiGLU (limit 1, not gpt-oss's 7, so that the clamp bites at these widths), top-2 by a
        # biased router, each
        # layer's experts in one fused gate_up_proj (gate in even columns) and one down_proj.
        return GptOssConfig(
            **{k: v for k, v in dict(COMMON, max_position_embeddings=24).items() if k != "intermediate_size"},
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=7,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "original_max_position_embeddings": 6, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False},
            swiglu_limit=1.0,
            tie_word_embeddings=False,
            attention_bias=True,
        )
    raise ValueError(family)


MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "llama32": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mistral_window": MistralForCausalLM,
    "qwen3_yarn": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "gpt_oss_mxfp4": GptOssForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,  # last: every family's seed is its index here
}
FEATURE = {
    "llama": ("llama3 rope scaling", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3_yarn": ("YaRN", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
    "mistral_window": ("the sliding window", "sliding_window", None),
    "qwen3_moe": ("renormalising the top-k gates", "norm_topk_prob", True),
    "gemma3": ("the output soft-cap", "final_logit_softcapping", None),
    "deepseek_v3": ("YaRN with its softmax mscale", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
    "gpt_oss": ("the clamp on the experts' SwiGLU", "swiglu_limit", 1e9),
    "deepseek_v2": ("choosing experts from the groups with the best single score", "topk_method", "greedy"),
}
"""The feature a fixture exists for: (what, the config attribute, its value with the feature off)."""
TOP_K = {"mixtral": 2, "qwen3_moe": 4, "deepseek_v3": 2, "gpt_oss": 2, "gpt_oss_mxfp4": 2, "deepseek_v2": 3}
MXFP4 = ("gpt_oss_mxfp4",)
"""Fixtures whose experts are stored MXFP4-packed, as the published gpt-oss checkpoints are."""
"""Experts each token picks, for the MoE families: the router's k-th and (k+1)-th choices must not be near-tied."""
FAMILIES = list(MODEL_CLASSES)
SEEDS = {f: 1000 + i for i, f in enumerate(FAMILIES)}
# Router std: with N(0, 1) the router logits (std ~8 for unit-RMS hidden states of width 64) saturate
# the softmax, the 2nd/3rd probabilities are both ~1e-8 (never > 1e-3 apart) and the second expert's
# weight is ~0, so the test could not see it. 0.3 keeps top-2 weights comparable; near-ties are
# excluded by reseeding (see ROUTER_MIN_GAP).
ROUTER_STD = 0.3
# Top-4 of 8: the 4th and 5th choices are small probabilities, whose absolute gap says little; what an fp32
# re-implementation could flip is the order of their logits, so that gap alone is held, 10x Mixtral's. DeepSeek's
# margins are on the scores it selects by (V3: sigmoid plus bias; V2: softmax probabilities of 8 experts, where the
# two implementations differ by about 1e-7 in fp32, so 2e-5 is 200 times that).
MIN_GAPS = {"qwen3_moe": (0.0, 1e-2), "deepseek_v3": (0.0, 1e-3), "deepseek_v2": (0.0, 2e-5)}
ATTEMPTS = 400
ROUTER_MIN_GAP = 1e-4  # on probabilities: 100x the fp32 difference between implementations
ROUTER_MIN_LOGIT_GAP = 1e-3  # and on logits, so an fp32 re-implementation cannot flip a choice


@torch.no_grad()
def reinit(model: torch.nn.Module, router_std: float = ROUTER_STD) -> None:
    """Matrices ~ N(0, 0.15), norm weights ~ 1 + N(0, 0.2), biases ~ N(0, 0.2), routers ~ N(0, router_std), sinks
    ~ N(0, 1)."""
    for name, p in model.named_parameters():  # tied parameters appear once
        if name.endswith("self_attn.sinks"):  # gpt-oss's sink logit per head: about an attention logit's size
            p.normal_(0.0, 1.0)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.2)
        elif "norm" in name and p.ndim == 1:
            p.normal_(0.0, 0.2).add_(1.0)
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")):
            p.normal_(0.0, router_std)
        elif p.ndim >= 2:
            p.normal_(0.0, 0.15)
        else:
            raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [experts, in, out] -> (blocks uint8 [experts, out, in/32, 16], scales uint8 [experts, out, in/32]): each
    run of 32 inputs of an output scaled by the power of two that brings its largest value to at most 6, every value
    rounded to the nearest E2M1 code, two codes per byte (the even input in the low nibble), as gpt-oss stores them."""
    rows = weight.transpose(1, 2).reshape(weight.shape[0], weight.shape[2], -1, 32)  # [experts, out, groups, 32]
    exponent = torch.ceil(torch.log2(rows.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = rows / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


@torch.no_grad()
def quantize_experts(model) -> dict[str, torch.Tensor]:
    """Round every expert matrix through MXFP4, dequantized by transformers' own converter, so the reference model
    computes with exactly the weights the packed tensors hold; returns the packed tensors by checkpoint name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_pack(p.float())
            p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
    assert packed, "no expert matrices to pack"
    return packed


def write_mxfp4(out: Path, packed: dict[str, torch.Tensor]) -> None:
    """Replace the saved expert matrices with their packed blocks and scales, and say so in config.json, as the
    published gpt-oss checkpoints do."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if f"{k}_blocks" not in packed}
    save_file({**tensors, **packed}, path, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def router_margin(model, input_ids: torch.Tensor, k: int) -> tuple[float, float]:
    """Smallest gap between the k-th and (k+1)-th router probability (and logit) over all tokens and layers."""
    captured = []
    # The router is mlp.gate (gpt-oss: mlp.router); DeepSeek's first layers are dense, without one.
    routers = [getattr(layer.mlp, "gate", getattr(layer.mlp, "router", None)) for layer in model.model.layers]
    routers = [r for r in routers if r is not None]
    hooks = [r.register_forward_hook(lambda mod, args, out: captured.append((mod, out[0]))) for r in routers]
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(captured) == len(routers)
    if hasattr(captured[0][0], "e_score_correction_bias"):
        return float("inf"), min(selection_gap(gate, logits, k) for gate, logits in captured)
    if getattr(captured[0][0], "topk_method", None) == "group_limited_greedy":
        return float("inf"), min(group_max_gap(gate, logits, k) for gate, logits in captured)
    prob_gaps, logit_gaps = [], []
    for _, router_logits in captured:
        probs = torch.softmax(router_logits.float(), dim=-1).sort(dim=-1, descending=True).values
        prob_gaps.append((probs[:, k - 1] - probs[:, k]).min().item())
        top = router_logits.float().sort(dim=-1, descending=True).values
        logit_gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(prob_gaps), min(logit_gaps)


def selection_gap(gate, logits: torch.Tensor, k: int) -> float:
    """DeepSeek-V3's choices, as margins: the topk_group-th against the next group score, and the k-th against the
    (k+1)-th biased sigmoid score inside the chosen groups (the least over tokens)."""
    scores = logits.float().sigmoid() + gate.e_score_correction_bias
    groups = scores.view(-1, gate.num_group, gate.num_experts // gate.num_group).topk(2, dim=-1)[0].sum(-1)
    ranked = groups.sort(dim=-1, descending=True).values
    gaps = [(ranked[:, gate.topk_group - 1] - ranked[:, gate.topk_group]).min().item()]
    chosen = torch.zeros_like(groups).scatter_(1, groups.topk(gate.topk_group, dim=-1)[1], 1.0)
    allowed = chosen.repeat_interleave(gate.num_experts // gate.num_group, dim=-1).bool()
    top = scores.masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True).values
    gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


def group_max_gap(gate, logits: torch.Tensor, k: int) -> float:
    """DeepSeek-V2's group_limited_greedy choices, as margins on the softmax scores: the topk_group-th against the
    next group's best score, and the k-th against the (k+1)-th score inside the chosen groups (least over tokens)."""
    scores = logits.float().softmax(dim=-1)
    groups = scores.view(-1, gate.num_group, gate.num_experts // gate.num_group).max(dim=-1).values
    ranked = groups.sort(dim=-1, descending=True).values
    gaps = [(ranked[:, gate.topk_group - 1] - ranked[:, gate.topk_group]).min().item()]
    chosen = torch.zeros_like(groups).scatter_(1, groups.topk(gate.topk_group, dim=-1)[1], 1.0)
    allowed = chosen.repeat_interleave(gate.num_experts // gate.num_group, dim=-1).bool()
    top = scores.masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True).values
    gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


@torch.no_grad()
def greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt)[None],
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0]
    assert out.shape[0] == prompt.shape[0] + NEW_TOKENS, out.shape
    assert torch.equal(out[: prompt.shape[0]], prompt)
    return out


def legacy_llama_config(path: Path) -> None:
    """Rewrite config.json into the pre-v5 layout: top-level rope_theta/rope_scaling and torch_dtype."""
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    new = {}
    for k, v in cfg.items():
        if k == "dtype":
            new["torch_dtype"] = v
            continue
        new[k] = v
    new["rope_theta"] = theta
    new["rope_scaling"] = {
        "factor": rope["factor"],
        "high_freq_factor": rope["high_freq_factor"],
        "low_freq_factor": rope["low_freq_factor"],
        "original_max_position_embeddings": rope["original_max_position_embeddings"],
        "rope_type": "llama3",
    }
    path.write_text(json.dumps(dict(sorted(new.items())), indent=2) + "\n")


def make_family(family: str, out_root: Path) -> None:
    seed = SEEDS[family]
    out = out_root / family
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    config = make_config(family)
    gen = torch.Generator().manual_seed(seed + 7)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]

    for attempt in range(ATTEMPTS):
        torch.manual_seed(seed + 100 * attempt)
        model = MODEL_CLASSES[family](config).to(torch.float32)
        reinit(model)
        for name, buffer in model.named_buffers():  # DeepSeek's selection bias is a buffer; drawn so it steers choices
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        packed = quantize_experts(model) if family in MXFP4 else {}
        model.eval()
        if family not in TOP_K:
            break
        k = TOP_K[family]
        prob_gap, logit_gap = router_margin(model, input_ids, k)
        print(f"  {family} attempt {attempt}: min gap between router choices {k} and {k + 1}: prob {prob_gap:.2e}, "
              f"logit {logit_gap:.2e}")
        min_prob_gap, min_logit_gap = MIN_GAPS.get(family, (ROUTER_MIN_GAP, ROUTER_MIN_LOGIT_GAP))
        if prob_gap > min_prob_gap and logit_gap > min_logit_gap:
            break
    else:
        raise RuntimeError(f"no {family} seed without router near-ties")

    with torch.no_grad():
        logits = model(input_ids).logits.float()
    gens = [greedy(model, p) for p in prompts]

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    save_kwargs = {"safe_serialization": True}
    if family == "qwen2":
        save_kwargs["max_shard_size"] = "200KB"
    model.save_pretrained(out, **save_kwargs)

    arrays = {
        "input_ids": input_ids.numpy().astype(np.int32),
        "logits": logits.numpy().astype(np.float32),
    }
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        arrays[f"prompt_{i}"] = p.numpy().astype(np.int32)
        arrays[f"greedy_{i}"] = g.numpy().astype(np.int32)
    np.savez(out / "reference.npz", **arrays)

    if family == "llama":
        legacy_llama_config(out / "config.json")
    if packed:
        write_mxfp4(out, packed)
    if family in FEATURE:
        what, key, off = FEATURE[family]
        # The feature must matter at these 24 positions, otherwise the fixture could not catch it ignored.
        without = make_config(family)
        setattr(without, key, off)
        without_model = MODEL_CLASSES[family](without).eval()
        without_model.load_state_dict(model.state_dict())
        with torch.no_grad():
            effect = (without_model(input_ids).logits - logits).abs().max().item()
        print(f"  {what} changes logits by up to {effect:.3f}")
        assert effect > 1e-2, (family, effect)

    # Reload what was written (legacy llama config included) and check it reproduces the reference.
    quantized = {"quantization_config": Mxfp4Config(dequantize=True)} if family in MXFP4 else {}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **quantized).eval()
    if family == "llama":
        rp = reloaded.config.rope_parameters
        assert rp["rope_type"] == "llama3" and rp["factor"] == 8.0, rp
    with torch.no_grad():
        re_logits = reloaded(input_ids).logits.float()
    diff = (re_logits - logits).abs().max().item()
    assert diff < 1e-5, (family, diff)
    for p, g in zip(prompts, gens, strict=True):
        assert torch.equal(greedy(reloaded, p), g), family
    for f in out.iterdir():  # save_pretrained writes safetensors files 0600
        f.chmod(0o644)
    print(f"  {family}: wrote {out} (reload max|diff| {diff:.1e})")


def check_export(directory: Path) -> int:
    ref = np.load(directory / "reference.npz")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids = torch.from_numpy(ref["input_ids"].astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()
    expected = ref["logits"].astype(np.float32)
    if logits.shape != expected.shape:
        print(f"FAIL {directory}: logits shape {logits.shape} != stored {expected.shape}")
        return 1
    max_abs = float(np.abs(logits - expected).max())
    rel = max_abs / max(float(np.abs(expected).max()), 1e-30)
    ok = rel <= CHECK_RTOL
    print(
        f"{'OK' if ok else 'FAIL'} {directory}: max|diff| {max_abs:.3e}, relative {rel:.3e} "
        f"(limit {CHECK_RTOL:.0e}), argmax agreement {(logits.argmax(-1) == expected.argmax(-1)).mean():.4f}"
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=FAMILIES, help="families to regenerate (default: all)")
    parser.add_argument("--out", type=Path, default=HERE, help="output root (default: this directory)")
    parser.add_argument("--check-export", type=Path, metavar="DIR", help="check an exported checkpoint DIR")
    args = parser.parse_args(argv)
    if args.check_export is not None:
        return check_export(args.check_export)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for family in args.only or FAMILIES:
        print(f"{family}:")
        make_family(family, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
