"""Hugging Face interop: imported checkpoints give transformers' logits, exports round-trip, bad input is named.

The references under tests/hf_reference were made by `transformers` itself (make_reference.py there, with
the `hf-reference` extra): tiny random checkpoints of each family with its special features on (Llama 3.1
rope scaling in the legacy config layout, a tied Llama 3.2, Mistral, Qwen2's Q/K/V biases in a sharded
save with an index, Qwen3's Q/K norms with head_dim != d_model / heads, Mixtral's 8 experts), and the
logits of a fixed batch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from spmd_train import load_config
from spmd_train.config.hf_config import model_section, read_hf_config, same_architecture
from spmd_train.errors import ConfigError
from spmd_train.hf import export_hf, load_hf_params
from spmd_train.hf import names as hf_names
from spmd_train.sharding.constrain import use_layout
from spmd_train.train.engine import Engine
from tests.runs import cli, main_in_process

REFERENCE = Path(__file__).parent / "hf_reference"
FAMILIES = ("llama", "llama32", "mistral", "mistral_window", "qwen2", "qwen3", "qwen3_yarn", "mixtral", "qwen3_moe",
            "gemma3", "deepseek_v3", "deepseek_v2", "gpt_oss", "gpt_oss_mxfp4")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2", "gpt_oss", "gpt_oss_mxfp4")
TOLERANCE = 1e-4
"""Largest |ours - transformers'| over the largest |logit|, fp32 on both sides."""


def _engine(family: str, devices, *overrides: str, directory: Path | None = None) -> Engine:
    directory = directory or REFERENCE / family
    ref = np.load(directory / "reference.npz") if (directory / "reference.npz").exists() else None
    batch, length = ref["input_ids"].shape if ref is not None else (8, 24)
    # Capacity for every token: the reference drops none (E / k = 4 slots per token's share).
    cfg = load_config(None, [f"checkpoint.load_from=hf:{directory}", f"train.seq_len={length}",
                             f"train.global_batch_size={batch}", "model.compute_dtype=float32",
                             "backends.capacity_factor=4.0", *overrides])
    return Engine.build(cfg, devices)


def _logits(engine: Engine, params, tokens: np.ndarray) -> np.ndarray:
    def forward(params, tokens):
        with use_layout(engine.layout):
            return nnx.merge(engine.graphdef, engine.model_params(params))(tokens)

    with jax.set_mesh(engine.mesh):
        return np.asarray(jax.jit(forward)(params, tokens))


def _error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


MESHES = {"1 device": ((), 1), "fsdp 2 x tensor 4": (("mesh.fsdp=2", "mesh.tensor=4"), 8),
          "fsdp 2 x expert 4": (("mesh.fsdp=2", "mesh.expert=4"), 8)}


SHARDED_IN_SLOW_TIER = ("mistral_window", "qwen3_yarn", "gpt_oss_mxfp4", "deepseek_v3")
"""Fixtures whose tensor names and sharding `mistral`, `qwen3` and `gpt_oss` already prove on 8 devices in the fast
tier (deepseek_v3's: its greedy generation on fsdp 2 x expert 4, which starts from the same sharded import)."""
LOGIT_CASES = [pytest.param(family, mesh, marks=[pytest.mark.slow] if mesh != "1 device" and family in
                            SHARDED_IN_SLOW_TIER else [])
               for family in FAMILIES for mesh in MESHES
               if mesh == "1 device" or (mesh == "fsdp 2 x expert 4") == (family in MOE_FAMILIES)]
"""Each fixture on 1 device, and on 8: tensor 4 for dense families, expert 4 for the mixtures of experts."""


@pytest.mark.parametrize(("family", "mesh"), LOGIT_CASES)
def test_imported_checkpoints_give_the_reference_logits(devices, family, mesh):
    overrides, count = MESHES[mesh]
    engine = _engine(family, devices[:count], *overrides)
    ref = np.load(REFERENCE / family / "reference.npz")
    params = load_hf_params(engine, REFERENCE / family)
    assert _error(_logits(engine, params, ref["input_ids"]), ref["logits"]) < TOLERANCE


def test_both_config_layouts_read_the_same(tmp_path):
    legacy = read_hf_config(REFERENCE / "llama")
    assert "rope_scaling" in legacy and "torch_dtype" in legacy  # the layout published checkpoints use
    current = {k: v for k, v in legacy.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    current["rope_parameters"] = {"rope_theta": legacy["rope_theta"], **legacy["rope_scaling"]}
    current["dtype"] = legacy["torch_dtype"]
    assert model_section(current) == model_section(legacy)
    assert model_section(legacy)["rope_scaling"] == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position": 64}


# --- mutations: each would be a silent conversion bug, and each moves the logits past the tolerance -------------


def _swap_experts(pieces):
    for p in pieces:
        if ".experts.0." in p.hf_name or ".experts.1." in p.hf_name:
            e = p.index[1]
            yield hf_names.Piece(p.hf_name, p.path, (p.index[0], 1 - e), p.layout)
        else:
            yield p


def _gate_and_up_swapped(pieces):
    swap = {"evens": "odds", "odds": "evens"}
    for p in pieces:
        kind = swap.get(p.layout.kind, p.layout.kind)
        yield hf_names.Piece(p.hf_name, p.path, p.index, hf_names.Layout(kind, p.layout.rope))


def _rope_left_interleaved(pieces):
    for p in pieces:  # DeepSeek's interleaved rotary pairs read as if they were rotate-half's
        yield hf_names.Piece(p.hf_name, p.path, p.index, hf_names.Layout(p.layout.kind)) if p.layout.rope else p


def _selection_bias_dropped(pieces):
    zero = type("Zero", (hf_names.Layout,), {"to_ours": lambda self, x, ours: np.zeros(ours, x.dtype)})("same")
    for p in pieces:
        yield hf_names.Piece(p.hf_name, p.path, p.index, zero) if p.path == "blocks.mlp.router_bias" else p


def _heads_transposed(pieces):
    # A plausible bug: splitting q_proj's rows as [head_dim, heads] instead of [heads, head_dim].
    wrong = type("Wrong", (hf_names.Layout,), {
        "to_ours": lambda self, x, ours: x.reshape(ours[2], ours[1], ours[0]).transpose(2, 1, 0)})("heads_in")
    for p in pieces:
        yield hf_names.Piece(p.hf_name, p.path, p.index, wrong) if p.path == "blocks.attn.wq" else p


@pytest.mark.parametrize(("family", "mutation", "overrides"), [
    ("mixtral", _swap_experts, ()),
    ("llama", _heads_transposed, ()),
    ("llama", None, ("model.rope_scaling=null",)),  # rope scaling dropped
    ("qwen3", None, ("model.norm_eps=1e-2",)),  # the Q/K norms' epsilon off
    ("qwen3_moe", None, ("model.moe.norm_topk_prob=true",)),  # config.json's norm_topk_prob=false misread
    ("mistral_window", None, ("model.sliding_window=null",)),  # the window ignored
    ("qwen3_yarn", None, ("model.rope_scaling.attention_factor=1.0",)),  # YaRN's factor on cos and sin left out
    ("qwen3_yarn", None, ("model.rope_scaling.truncate=false",)),  # the ramp's ends not rounded out
    ("gpt_oss", _gate_and_up_swapped, ()),  # gate_up_proj's columns read as [gate | up] halves' other parity
    ("gpt_oss", None, ("model.moe.swiglu_limit=100.0",)),  # config.json's swiglu_limit misread
    ("gemma3", None, ("model.scale_embeddings=false",)),  # the embeddings' sqrt(d_model) left out
    ("gemma3", None, ("model.rope_local_theta=null",)),  # the sliding layer's own RoPE base ignored
    ("gemma3", None, ("model.query_pre_attn_scalar=null",)),  # 1/sqrt(head_dim) instead of Gemma's query scale
    ("gemma3", None, ("model.mlp_activation=silu",)),  # GeGLU read as SwiGLU
    ("deepseek_v3", _rope_left_interleaved, ()),
    ("deepseek_v3", _selection_bias_dropped, ()),
    ("deepseek_v3", None, ("model.moe.routed_scaling_factor=1.0",)),
    ("deepseek_v3", None, ("model.moe.topk_group=4",)),  # experts chosen from every group
    ("deepseek_v2", None, ("model.moe.group_score=top2_sum",)),  # groups ranked as DeepSeek-V3 ranks them
    ("deepseek_v2", None, ("model.moe.norm_topk_prob=true",)),  # the gates renormalised
])
def test_a_conversion_bug_fails_the_comparison(devices, monkeypatch, family, mutation, overrides):
    if mutation is not None:
        original = hf_names.pieces
        monkeypatch.setattr("spmd_train.hf.import_params.pieces",
                            lambda model, family: list(mutation(original(model, family))))
    engine = _engine(family, devices[:1], *overrides)
    ref = np.load(REFERENCE / family / "reference.npz")
    assert _error(_logits(engine, load_hf_params(engine, REFERENCE / family), ref["input_ids"]), ref["logits"]) \
        > 100 * TOLERANCE


def test_deepseek_v3_without_yarns_softmax_factor_fails_the_comparison(devices, monkeypatch):
    # YaRN's mscale squared left off MLA's softmax: no config key turns it off alone, so the function is replaced.
    monkeypatch.setattr("spmd_train.models.transformer.yarn_softmax_factor", lambda scaling: 1.0)
    engine = _engine("deepseek_v3", devices[:1])
    ref = np.load(REFERENCE / "deepseek_v3" / "reference.npz")
    params = load_hf_params(engine, REFERENCE / "deepseek_v3")
    assert _error(_logits(engine, params, ref["input_ids"]), ref["logits"]) > 100 * TOLERANCE


# --- export ---------------------------------------------------------------------------------------------------


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="np") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize(("family", "mesh"), [("qwen2", ("mesh.fsdp=2", "mesh.tensor=4")),
                                              pytest.param("mistral_window", ("mesh.fsdp=2", "mesh.tensor=4"),
                                                           marks=pytest.mark.slow),  # layer kinds: gemma3's too
                                              pytest.param("qwen3_yarn", (), marks=pytest.mark.slow),  # deepseek's YaRN
                                              ("gemma3", ("mesh.fsdp=2", "mesh.tensor=4")),
                                              ("mixtral", ("mesh.fsdp=2", "mesh.expert=4")),
                                              ("qwen3_moe", ("mesh.fsdp=2", "mesh.expert=4")),
                                              ("deepseek_v3", ("mesh.fsdp=2", "mesh.expert=4")),
                                              ("deepseek_v2", ()),
                                              ("gpt_oss", ("mesh.fsdp=2", "mesh.expert=4"))])
def test_import_then_export_gives_the_same_bytes_and_an_equivalent_config(devices, tmp_path, family, mesh):
    engine = _engine(family, devices if mesh else devices[:1], *mesh)
    params = load_hf_params(engine, REFERENCE / family)
    base = read_hf_config(REFERENCE / family)
    out = export_hf(engine, params, tmp_path / "out", base_config=base, dtype="float32", max_shard_bytes=150_000)
    assert len(out.files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    theirs, ours = _tensors(REFERENCE / family), _tensors(tmp_path / "out")
    assert set(index["weight_map"]) == set(ours) == set(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].tobytes() == value.tobytes(), name
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert same_architecture(base, exported) == {}
    assert {k: v for k, v in exported.items() if k not in ("head_dim",)} == \
        {k: v for k, v in base.items() if k not in ("head_dim",)}


def test_a_model_trained_here_exports_and_imports_back_exactly(devices, tmp_path):
    from spmd_train.train.trainer import Trainer

    # Trained with a multi-token prediction module, which export leaves out: the next-token logits are unchanged.
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", "train.steps=2", "mesh.fsdp=4",
                                            "mesh.tensor=2", "checkpoint.every=0", "model.qkv_bias=true",
                                            "model.mtp.depth=1"])
    trainer = Trainer(cfg, devices=devices)
    trainer.run()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 24)).astype(np.int32)
    ours = _logits(trainer.engine, trainer.state.params, tokens)
    export_hf(trainer.engine, trainer.state.params, tmp_path / "exported" / "hf", dtype="float32")  # parents made
    trainer.close()
    (tmp_path / "exported" / "hf").rename(tmp_path / "hf")
    config = read_hf_config(tmp_path / "hf")
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "torch_dtype" in config  # legacy layout: any version
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    # What make_reference.py --check-export compares in transformers (run by hand with the hf-reference extra).
    np.savez(tmp_path / "hf" / "reference.npz", input_ids=tokens, logits=ours)
    back = _engine("", devices[:1], directory=tmp_path / "hf")
    assert _error(_logits(back, load_hf_params(back, tmp_path / "hf"), tokens), ours) < 1e-6


# --- bad input: exit 2, the value named, nothing written ------------------------------------------------------


def _copy(family: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(REFERENCE / family, tmp_path / family))


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _unsupported(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))


def _big_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 300}}, "added_tokens": []}))


@pytest.mark.parametrize(("breakage", "overrides", "message"), [
    (_no_config, (), "has no config.json"),
    (_no_weights, (), "has no *.safetensors weights"),
    (_unsupported, (), "unsupported architecture: model_type='gpt2'"),
    (None, ("model.d_ff=96",), "model.layers.0.mlp.gate_proj.weight has shape [128, 64]"),
    (_big_tokenizer, (), "token ids up to 300, more than the model's vocabulary of model.vocab_size=256"),
])
def test_bad_checkpoints_exit_2_naming_the_problem_and_write_nothing(tmp_path, capsys, breakage, overrides, message):
    # In process (a process start is 3-4 s of the fast tier per case): the exit status a shell sees for a refused
    # convert is test_convert_round_trip_through_the_cli's, and for a refused config test_cli's.
    source = _copy("llama32", tmp_path)
    if breakage is not None:
        breakage(source)
    run = tmp_path / "run"
    code, _, err = main_in_process("convert", "hf", str(source), "--to", str(run), *overrides, capsys=capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not run.exists()


def test_unsupported_config_fields_are_named():
    cfg = read_hf_config(REFERENCE / "llama32")
    supported = r"\(supported: default, linear, llama3, yarn\)"
    with pytest.raises(ConfigError, match=r"rope scaling type 'longrope' is not supported " + supported):
        model_section({**cfg, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        model_section({**cfg, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="attention_bias=True is not supported"):
        model_section({**cfg, "attention_bias": True})


def test_gemma3_fields_its_transformers_code_ignores_or_lacks_are_refused():
    from spmd_train.config.hf_config import infer_family
    from spmd_train.config.load import model_from_record

    cfg = read_hf_config(REFERENCE / "gemma3")
    with pytest.raises(ConfigError, match="attn_logit_softcapping=50.0 is not supported .transformers' Gemma 3 does "
                                          "not apply it"):
        model_section({**cfg, "attn_logit_softcapping": 50.0})
    with pytest.raises(ConfigError, match="hidden_activation='gelu' is not supported .valid: gelu_pytorch_tanh, silu"):
        model_section({**cfg, "hidden_activation": "gelu"})
    gemma = model_from_record(model_section(cfg))
    assert infer_family(gemma).model_type == "gemma3_text"
    with pytest.raises(ConfigError, match=r"no supported Hugging Face family \(.*gemma3_text.*\) holds "
                                          "model.attn_logit_softcap=50.0; the model trains, it does not export"):
        infer_family(model_from_record({**model_section(cfg), "attn_logit_softcap": 50.0}))
    with pytest.raises(ConfigError, match="this model: model.scale_embeddings=false; valid: all four true"):
        infer_family(model_from_record({**model_section(cfg), "scale_embeddings": False}))
    scaled = {**model_section(cfg), "rope_local_theta": None}
    with pytest.raises(ConfigError, match="Gemma 3's sliding layers take no rope_scaling"):
        infer_family(model_from_record(scaled))


def test_mxfp4_experts_import_exactly_and_export_unquantized(devices, tmp_path):
    # The fixture's experts are MXFP4-packed (blocks and scales, as gpt-oss publishes them); its logits are
    # transformers' on the weights its own converter dequantizes.
    source = REFERENCE / "gpt_oss_mxfp4"
    assert {"mxfp4"} == {read_hf_config(source)["quantization_config"]["quant_method"]}
    assert any(name.endswith("gate_up_proj_blocks") for name in _tensors(source))
    engine = _engine("gpt_oss_mxfp4", devices[:1])
    params = load_hf_params(engine, source)
    export_hf(engine, params, tmp_path / "out", base_config=read_hf_config(source), dtype="float32")
    exported = read_hf_config(tmp_path / "out")
    assert "quantization_config" not in exported
    ours = _tensors(tmp_path / "out")
    assert ours["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert not any(name.endswith(("_blocks", "_scales")) for name in ours)
    ref = np.load(source / "reference.npz")
    back = _engine("", devices[:1], directory=tmp_path / "out")
    assert _error(_logits(back, load_hf_params(back, tmp_path / "out"), ref["input_ids"]), ref["logits"]) < TOLERANCE


def test_mxfp4_scales_that_do_not_pair_with_their_blocks_are_named(tmp_path):
    from safetensors.numpy import save_file

    from spmd_train.hf.files import SafetensorsDir

    source = _copy("gpt_oss_mxfp4", tmp_path)
    tensors = _tensors(source)
    name = "model.layers.0.mlp.experts.down_proj"
    tensors[f"{name}_scales"] = tensors[f"{name}_scales"][:, :-1]
    save_file(tensors, str(source / "model.safetensors"))
    files = SafetensorsDir(source)
    assert files.shapes[name] == (4, 32, 64)  # listed dequantized: [experts, in, out]
    with pytest.raises(ConfigError, match=f"{name} in .*: MXFP4 blocks uint8.4, 64, 1, 16. and scales uint8.4, 63, "
                                          r"1. do not pair"):
        files.tensor(name)


def test_deepseek_v3_mtp_modules_import_and_export_or_stay_unread(devices, tmp_path):
    from safetensors.numpy import save_file

    from spmd_train.config.model_schema import MTPConfig

    source = _copy("deepseek_v3", tmp_path)
    tensors = _tensors(source)
    norm = tensors["model.norm.weight"]
    rng = np.random.default_rng(0)
    draw = lambda *shape: rng.standard_normal(shape).astype(norm.dtype)
    d = norm.shape[0]
    # Layer 3 after the 3 layers, as DeepSeek-V3 ships its MTP module: a layer of the trunk's kind, its own norms and
    # projection, and copies of the shared embedding and head.
    layer = {k.replace("model.layers.2.", "model.layers.3."): draw(*v.shape) for k, v in tensors.items()
             if ".layers.2." in k}
    mtp = {**layer, "model.layers.3.enorm.weight": draw(d), "model.layers.3.hnorm.weight": draw(d),
           "model.layers.3.eh_proj.weight": draw(d, 2 * d), "model.layers.3.shared_head.norm.weight": draw(d),
           "model.layers.3.embed_tokens.weight": tensors["model.embed_tokens.weight"],
           "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"]}
    save_file({**tensors, **mtp}, str(source / "model.safetensors"))
    config = read_hf_config(source)
    (source / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ref = np.load(source / "reference.npz")

    engine = _engine("deepseek_v3", devices[:1], directory=source)
    assert engine.cfg.model.mtp == MTPConfig(depth=1, loss_weight=0.1)
    params = load_hf_params(engine, source)
    assert _error(_logits(engine, params, ref["input_ids"]), ref["logits"]) < TOLERANCE
    np.testing.assert_array_equal(params["mtp"]["eh_proj"][0], mtp["model.layers.3.eh_proj.weight"].T)
    # Export writes the module back as layer 3, byte for byte, copies included; --drop-mtp leaves it out.
    export_hf(engine, params, tmp_path / "out", base_config=read_hf_config(source), dtype="float32")
    written = _tensors(tmp_path / "out")
    assert sorted(written) == sorted({**tensors, **mtp})
    assert all(written[k].tobytes() == v.tobytes() for k, v in mtp.items())
    assert read_hf_config(tmp_path / "out")["num_nextn_predict_layers"] == 1
    export_hf(engine, params, tmp_path / "dropped", base_config=read_hf_config(source), dtype="float32",
              drop_mtp=True)
    assert sorted(_tensors(tmp_path / "dropped")) == sorted(tensors)
    assert read_hf_config(tmp_path / "dropped")["num_nextn_predict_layers"] == 0

    # model.mtp=null at import leaves the module unread; the trunk is the same.
    engine = _engine("deepseek_v3", devices[:1], "model.mtp=null", directory=source)
    assert _error(_logits(engine, load_hf_params(engine, source), ref["input_ids"]), ref["logits"]) < TOLERANCE
    (source / "config.json").write_text(json.dumps(config))  # without the count, the same tensors are refused
    with pytest.raises(ConfigError, match=r"holds 44 tensor\(s\) this architecture has no place for: "
                                          r"model.layers.{i}.eh_"):
        load_hf_params(engine, source)


def test_a_family_without_mtp_modules_imports_them_fresh(devices, tmp_path):
    engine = _engine("qwen3", devices[:1], "model.mtp.depth=1")
    params = load_hf_params(engine, REFERENCE / "qwen3")
    ref = np.load(REFERENCE / "qwen3" / "reference.npz")
    assert _error(_logits(engine, params, ref["input_ids"]), ref["logits"]) < TOLERANCE
    # Drawn as a new model's (normal weights, unit norms), not left at zero, so the module trains from the start.
    assert np.std(np.asarray(params["mtp"]["eh_proj"])) == pytest.approx(engine.cfg.model.init_std, rel=0.2)
    np.testing.assert_array_equal(np.asarray(params["mtp"]["head_norm"]["scale"]), 1.0)


def test_deepseek_v3_fields_outside_its_model_are_refused():
    from spmd_train.config.hf_config import infer_family
    from spmd_train.config.load import model_from_record

    cfg = read_hf_config(REFERENCE / "deepseek_v3")
    with pytest.raises(ConfigError, match="rope_interleave=False is not supported"):
        model_section({**cfg, "rope_interleave": False})
    with pytest.raises(ConfigError, match="rms_norm_eps=1e-05 is not supported .its latent norms' epsilon is fixed"):
        model_section({**cfg, "rms_norm_eps": 1e-5})
    with pytest.raises(ConfigError, match="this model: model.norm_eps=1e-05 .its latent norms' epsilon is fixed"):
        infer_family(model_from_record({**model_section(cfg), "norm_eps": 1e-5}))


def test_deepseek_v2_fields_outside_its_model_are_refused():
    from spmd_train.config.hf_config import infer_family
    from spmd_train.config.load import model_from_record

    cfg = read_hf_config(REFERENCE / "deepseek_v2")
    with pytest.raises(ConfigError, match="topk_method='noaux_tc' is not supported .valid: greedy .top-k over every "
                                          "expert., group_limited_greedy"):
        model_section({**cfg, "topk_method": "noaux_tc"})
    with pytest.raises(ConfigError, match="norm_topk_prob=True is not supported .transformers' DeepSeek-V2 does not "
                                          "renormalise"):
        model_section({**cfg, "norm_topk_prob": True})
    with pytest.raises(ConfigError, match="scoring_func='sigmoid' is not supported"):
        model_section({**cfg, "scoring_func": "sigmoid"})
    # Greedy routing ignores the group fields it may still carry; the group-limited one reads them.
    assert model_section({**cfg, "topk_method": "greedy"})["moe"] | {"n_group": 4, "topk_group": 2} == \
        model_section(cfg)["moe"]
    assert (model_section(cfg)["moe"]["n_group"], model_section(cfg)["moe"]["topk_group"]) == (4, 2)
    # A model routed as DeepSeek-V3 ranks groups is not written as DeepSeek-V2, and says why.
    model = model_from_record(model_section(cfg))
    with pytest.raises(ConfigError, match="groups ranked by their best score.*this model: model.moe.group_score="
                                          "top2_sum"):
        infer_family(model_from_record({**model_section(cfg), "moe": {**model_section(cfg)["moe"],
                                                                      "group_score": "top2_sum"}}))
    assert infer_family(model).model_type == "deepseek_v2"


def test_gpt_oss_fields_outside_its_model_are_refused():
    cfg = read_hf_config(REFERENCE / "gpt_oss")
    with pytest.raises(ConfigError, match="swiglu_alpha=1.5 is not supported .the clamped SwiGLU's slope is gpt-oss's; "
                                          "valid: 1.702"):
        model_section({**cfg, "swiglu_alpha": 1.5})
    with pytest.raises(ConfigError, match="attention_bias=False is not supported"):
        model_section({**cfg, "attention_bias": False})
    with pytest.raises(ConfigError, match=r"quantization_config.quant_method='gptq' is not supported \(valid: mxfp4"):
        model_section({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}})


@pytest.mark.faults
def test_an_import_killed_before_its_checkpoint_was_finished_can_be_rerun_into_the_same_directory(tmp_path, capsys):
    # What `convert hf` killed mid-write leaves: its (unlocked) lock file, config.json, an unfinished Orbax step.
    run = tmp_path / "run"
    (run / "checkpoints" / "0.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
    (run / ".lock").write_text('{"host": "h", "pid": 1, "started": "then"}')
    (run / "config.json").write_text("{}")
    args = ("convert", "hf", str(REFERENCE / "llama32"), "--to", str(run), "run.simulate_devices=8")
    code, out, err = main_in_process(*args, capsys=capsys)
    assert code == 0, err
    assert (run / "checkpoints" / "0").is_dir() and "into" in out
    # A finished step, or a file an import does not write, is kept: refused, nothing written.
    code, _, err = main_in_process(*args, capsys=capsys)
    assert code == 2 and "already holds files" in err
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    code, _, err = main_in_process(*args[:4], str(other), *args[5:], capsys=capsys)
    assert code == 2 and "already holds files" in err and sorted(p.name for p in other.iterdir()) == [
        "checkpoints", "notes.txt"]


@pytest.mark.slow
def test_convert_round_trip_through_the_cli(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    result = cli("convert", "hf", str(REFERENCE / "qwen3"), "--to", str(run), "run.simulate_devices=8",
                 "mesh.fsdp=2", "mesh.tensor=4")
    assert result.returncode == 0, result.stderr
    assert "into" in result.stdout and (run / "checkpoints" / "0").is_dir()
    result = cli("convert", "to-hf", str(run), "--to", str(out))
    assert result.returncode == 0, result.stderr
    assert "float32" in result.stdout  # the imported checkpoint's dtype
    theirs, ours = _tensors(REFERENCE / "qwen3"), _tensors(out)
    assert all(ours[k].tobytes() == v.tobytes() for k, v in theirs.items()) and set(ours) == set(theirs)
    again = cli("convert", "to-hf", str(run), "--to", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_v"])
def test_interleaved_pipeline_layer_order_survives_export_and_import(devices, tmp_path, schedule):
    # Interleaved 1F1B and ZB-V store the layer stack out of model order (engine.layer_order); files are in model order.
    pipe_cfg = load_config("configs/pipeline.yaml", [f"parallel.pipeline_schedule={schedule}",
                                                     "parallel.virtual_stages=2", "model.qk_norm=true"])
    pipe = Engine.build(pipe_cfg, devices)
    assert pipe.layer_order is not None
    params = pipe.init_state().params
    export_hf(pipe, params, tmp_path / "hf", dtype="float32")
    one = _engine("", devices[:1], "model.compute_dtype=float32", directory=tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, pipe_cfg.model.vocab_size, (8, 24)).astype(np.int32)
    assert _error(_logits(one, load_hf_params(one, tmp_path / "hf"), tokens), _logits(pipe, params, tokens)) < 1e-6
    back = load_hf_params(pipe, tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(("family", "mesh"), [("llama", ("mesh.fsdp=2", "mesh.tensor=4")), ("qwen2", ()),
                                              ("qwen3", ("mesh.fsdp=2", "mesh.tensor=4")),
                                              # The window's ring cache and YaRN's tables: gemma3's and
                                              # deepseek_v3's generation in the fast tier, these two in the slow one.
                                              pytest.param("mistral_window", ("mesh.fsdp=2", "mesh.tensor=4"),
                                                           marks=pytest.mark.slow),
                                              pytest.param("qwen3_yarn", ("mesh.fsdp=2", "mesh.tensor=4"),
                                                           marks=pytest.mark.slow),
                                              ("gemma3", ("mesh.fsdp=2", "mesh.tensor=4")),
                                              ("mixtral", ("mesh.fsdp=2", "mesh.expert=4")),
                                              ("qwen3_moe", ("mesh.fsdp=2", "mesh.expert=4")),
                                              ("deepseek_v3", ("mesh.fsdp=2", "mesh.expert=4")),
                                              ("deepseek_v2", ()),
                                              ("gpt_oss", ("mesh.fsdp=2", "mesh.expert=4"))])
def test_greedy_generation_from_an_imported_model_equals_transformers(devices, family, mesh):
    from spmd_train.train.generation import generate

    engine = _engine(family, devices if mesh else devices[:1], *mesh)
    ref = np.load(REFERENCE / family / "reference.npz")
    prompts = [ref["prompt_0"].tolist(), ref["prompt_1"].tolist()]  # of different lengths, in one batch
    out = generate(engine, load_hf_params(engine, REFERENCE / family), prompts, max_new_tokens=12)
    for i, prompt in enumerate(prompts):
        assert prompt + out.tokens[i] == ref[f"greedy_{i}"].tolist(), f"prompt {i}"
