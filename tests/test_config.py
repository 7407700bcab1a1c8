"""Config loading: presets, precedence, overrides, and the errors a user sees."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spmd_train.config import Config, load_config, parse_overrides
from spmd_train.config.checks import check_layout
from spmd_train.config.mesh_schema import LOGICAL_AXES, RulesConfig
from spmd_train.config.resolved_rules import resolve_rules
from spmd_train.config.validity import divisors
from spmd_train.errors import ConfigError
from tests.runs import cli_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # Runs either train on 8 simulated CPU devices or are plans for real TPU slices or GPU clusters.
    assert cfg.run.simulate_devices == 8 or (cfg.run.simulate_devices is None and
                                             ("_v5p" in path.stem or "_h100" in path.stem))


def test_presets_fill_in_and_explicit_values_win(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    assert (cfg.model.d_model, cfg.model.num_layers) == (64, 2)  # from models/tiny.yaml
    assert (cfg.mesh.fsdp, cfg.mesh.tensor) == (4, 2)  # run config beats meshes/fsdp_tp.yaml (fsdp -1)
    assert cfg.parallel.zero_stage == 3
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["mesh.tensor=4", "mesh.fsdp=2", "model.d_model=128"])
    assert (cfg.mesh.tensor, cfg.mesh.fsdp, cfg.model.d_model) == (4, 2, 128)
    sp = load_config(ROOT / "configs" / "mesh_presets.yaml", ["mesh.preset=tp_sp"])
    assert sp.parallel.sequence_parallel and sp.mesh.tensor == 4


def test_defaults_without_a_file():
    cfg = load_config(None)
    # Everything is the schema's default except the rules, which come from the default rules preset, and
    # precision.params / compute, which hold the model's dtypes (one setting under two names).
    assert (cfg.precision.params, cfg.precision.compute) == (cfg.model.param_dtype, cfg.model.compute_dtype)
    unset = dataclasses.replace(cfg.precision, params=None, compute=None)
    rules = dataclasses.replace(cfg.mesh, rules=RulesConfig())
    assert dataclasses.replace(cfg, mesh=rules, precision=unset) == Config()
    preset = yaml.safe_load((ROOT / "meshes" / "rules" / "default.yaml").read_text())
    assert {k: list(v) for k, v in cfg.mesh.rules.activations.items()} == preset["activations"]
    assert {k: list(v) for k, v in cfg.mesh.rules.params.items()} == preset["params"]


def test_rules_are_a_preset_with_overrides_and_the_code_added_rules_are_named(tmp_path):
    cfg = load_config(None, ["mesh.rules.params.vocab=[]", "mesh.rules.activations.heads=[]",
                             "parallel.sequence_parallel=true", "mesh.pipeline=2"])
    rules = resolve_rules(cfg)
    assert rules.params["vocab"] == () and rules.params["embed"] == ("fsdp", "sequence")  # override, preset
    assert rules.params["mlp"] == ("tensor",)  # inherited from the activation rules
    assert rules.activations["heads"] == () and rules.params["heads"] == ()
    assert rules.activations["norm_length"] == ("sequence", "tensor") and rules.params["layers"] == ("pipeline",)
    assert len(rules.added) == 2 and "parallel.sequence_parallel" in rules.added[0]
    assert "mesh.pipeline=2" in rules.added[1]
    assert rules.batch_axes == ("data", "fsdp", "expert")
    custom = tmp_path / "meshes" / "rules" / "dp_only.yaml"
    custom.parent.mkdir(parents=True)
    custom.write_text("activations:\n  batch: [data]\nparams: {}\n")
    cfg = load_config(None, [f"mesh.rules.preset={custom}"])
    assert cfg.mesh.rules.activations == {"batch": ("data",)} and resolve_rules(cfg).params == {"batch": ("data",)}
    with pytest.raises(ConfigError, match="mesh.rules.preset='nope' is not a known preset; valid presets: default"):
        load_config(None, ["mesh.rules.preset=nope"])


def test_overrides_parse_yaml_scalars_and_lists():
    assert parse_overrides(["optim.lr=1e-3", "a.b=true", "mesh.rules.params.embed=[]", "x.y=[data, fsdp]"]) == {
        "optim": {"lr": 1e-3},
        "a": {"b": True},
        "mesh": {"rules": {"params": {"embed": []}}},
        "x": {"y": ["data", "fsdp"]},
    }
    cfg = load_config(None, ["mesh.rules.params.embed=[]", "optim.lr=2e-4"])
    assert cfg.mesh.rules.params["embed"] == () and cfg.optim.lr == 2e-4
    assert resolve_rules(cfg).params["mlp"] == ("tensor",)  # untouched entries keep their defaults


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["model.d_modle=64"], ["model.d_modle", "did you mean 'model.d_model'", "num_layers"]),
        (["model.d_model=abc"], ["model.d_model='abc'", "valid integer"]),
        (["model.d_model='64'"], ["model.d_model='64'", "valid integer"]),
        (["parallel.zero_stage=5"], ["parallel.zero_stage=5", "0, 1, 2 or 3"]),
        (["parallel.remat=sometimes"], ["parallel.remat='sometimes'", "save_matmuls"]),
        (["model.compute_dtype=float64"], ["model.compute_dtype='float64'", "bfloat16"]),
        (["mesh.data=-1", "mesh.fsdp=-1"], ["mesh.data=-1", "mesh.fsdp=-1", "at most one"]),
        (["mesh.tensor=0"], ["mesh.tensor=0", "positive integer or -1"]),
        (["model.num_heads=8", "model.num_kv_heads=3"], ["model.num_kv_heads=3", "1, 2, 4, 8"]),
        (["mesh.rules.params.embed=[fsdpp]"], ["mesh.rules.params.embed", "'fsdpp'", "tensor"]),
        (["mesh.data=4", "mesh.dcn.data=3"], ["mesh.dcn.data=3", "1, 2, 4"]),
        (["model.preset=nonexistent"], ["model.preset='nonexistent'", "tiny", "llama3-8b"]),
        (["train.steps=0"], ["train.steps=0", "greater than or equal to 1"]),
        (["data.val_fraction=1.0"], ["data.val_fraction=1.0", "less than 1"]),
        (["model.moe.num_experts=0"], ["model.moe.num_experts=0", "greater than or equal to 1"]),
        (["model.mlp_activation=gelu_tanh", "model.moe.num_experts=4"], ["model.mlp_activation=gelu_tanh",
                                                                          "valid with model.moe: silu"]),
        (["model.attention=xla"], ["'model.attention' has moved", "backends.attention"]),
        (["model.moe_impl=dropless"], ["'model.moe_impl' has moved", "backends.moe"]),
        (["backends.attention_blocks=[12,64]"], ["backends.attention_blocks=[12, 64]", "positive multiples of 8"]),
        (["backends.attention_blocks=[64]"], ["backends.attention_blocks", "[64]"]),
        (["optim.lr=-1"], ["optim.lr=-1", "greater than or equal to 0"]),
        (["optim.lr=.nan"], ["optim.lr=nan", "finite"]),
        (["optim.lr=.inf"], ["optim.lr=inf", "finite"]),
        (["optim.b1=1.0"], ["optim.b1=1.0", "less than 1"]),
        (["optim.b2=-0.5"], ["optim.b2=-0.5", "greater than or equal to 0"]),
        (["optim.eps=-1e-8"], ["optim.eps=-1e-08", "greater than or equal to 0"]),
        (["optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1", "greater than or equal to 0"]),
        (["optim.clip_norm=-1"], ["optim.clip_norm=-1", "greater than 0"]),
        (["optim.min_lr_ratio=1.5"], ["optim.min_lr_ratio=1.5", "less than or equal to 1"]),
        (["model.init_std=-0.02"], ["model.init_std=-0.02", "greater than 0"]),
        (["model.rope_theta=0"], ["model.rope_theta=0", "greater than 0"]),
        (["train.steps=100000000000"], ["train.steps=100000000000", "less than or equal to 2147483647"]),
        (["mesh.rules.activations.embedd=[tensor]"], ["mesh.rules.activations", "'embedd' (did you mean 'embed'?)",
                                                      "valid: batch, length"]),
        (["train.resume_step=3", "train.resume=never"], ["train.resume_step=3", "train.resume=never"]),
        (["train.resume_step=300", "train.steps=100"], ["train.resume_step=300", "past train.steps=100"]),
        (["nonsense"], ["'nonsense'", "section.key=value"]),
        (["bogus.key=1"], ["unknown key 'bogus'", "model"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_valid(overrides, needles):
    """Each value the schema refuses (ranges included: a negative clip_norm flips the gradient, rope_theta 0 is NaN
    at step 1) is named with its key and what would be valid."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(listy)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match=r"empty.yaml' is empty \(valid: a mapping of sections"):
        load_config(empty)
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  steps: 10\n  lr: 1\n  steps: 20\n")
    with pytest.raises(ConfigError, match=r"(?s)twice.yaml' is not valid YAML.*found the key 'steps' twice"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"is a directory \(valid: a YAML file"):
        load_config(tmp_path)


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(evil)


def test_preset_given_as_path_and_preset_sections_are_limited(tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("model:\n  d_model: 96\n  num_heads: 6\n  num_kv_heads: 2\n")
    assert load_config(None, [f"model.preset={preset}"]).model.d_model == 96
    preset.write_text("train:\n  steps: 5\n")
    with pytest.raises(ConfigError, match="may hold only"):
        load_config(None, [f"model.preset={preset}"])


def test_clipping_can_be_switched_off_and_every_default_rule_names_a_logical_axis():
    assert load_config(None, ["optim.clip_norm=null"]).optim.clip_norm is None
    rules = load_config(None, []).mesh.rules
    assert set(rules.activations) | set(rules.params) <= set(LOGICAL_AXES)


def test_overrides_given_as_one_string_are_refused_clearly():
    with pytest.raises(ConfigError, match=r"not the string 'mesh.fsdp=2 mesh.tensor=4' \(valid: \['mesh.fsdp=2', "
                                          r"'mesh.tensor=4'\]\)"):
        load_config(None, "mesh.fsdp=2 mesh.tensor=4")


# --- Found by tests/test_config_fuzz.py: each was a traceback (or a hang) before; now a ConfigError naming the key.


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        # jax's DuplicateSpecError from deep inside Engine.build.
        (["mesh.rules.params.heads=[tensor, tensor]"], ["mesh.rules.params", "'heads'", "naming a mesh axis twice"]),
        # AttributeError in the loader: 'str' object has no attribute 'get'.
        (["mesh=%"], ["mesh='%'", "it is a section"]),
        # Past int64: jax's TypeError while shaping the parameters, an OverflowError for seq_len.
        (["model.num_layers=9223372036854775808"], ["model.num_layers=9223372036854775808", "2147483647"]),
        (["train.seq_len=9223372036854775808"], ["train.seq_len=9223372036854775808", "2147483647"]),
        (["train.spike_window=9223372036854775808"], ["train.spike_window=9223372036854775808", "2147483647"]),
        # numpy's ValueError (negative seed) in the data source, jax's OverflowError past int64 in the keys.
        (["train.seed=-1"], ["train.seed=-1", "greater than or equal to 0"]),
        (["train.seed=9223372036854775808"], ["train.seed=9223372036854775808", "9223372036854775807"]),
        # ValueError: the Markov table's size was too long a number to print in its own error message.
        (["data.order=2147483647"], ["data.order=2147483647", "less than or equal to 24"]),
        # IndexError inside jax.distributed.initialize, which splits the address at its last ':'.
        (["run.coordinator=abc", "run.num_processes=2", "run.process_id=0"], ["run.coordinator='abc'", "host:port"]),
    ],
)
def test_inputs_the_fuzzer_found_are_refused_naming_the_key(overrides, needles):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(err.value)


def _sizes(cfg: Config, devices: int = 8) -> dict[str, int]:
    sizes = cfg.mesh.sizes()
    rest = devices // math.prod(s for s in sizes.values() if s != -1)
    return {axis: rest if s == -1 else s for axis, s in sizes.items()}


def test_a_prime_layer_count_is_refused_at_once():
    # The MoE check listed the divisors of model.num_layers by trial division up to n: 2**31 - 1 took minutes.
    cfg = load_config(ROOT / "configs/moe.yaml", ["model.num_layers=2147483647"])
    with pytest.raises(ConfigError, match=r"model.moe.every=2 is invalid for model.num_layers=2147483647: .*"
                                          r"\(valid: 1, 2147483647;"):
        check_layout(cfg, _sizes(cfg))
    assert divisors(12) == "1, 2, 3, 4, 6, 12" and divisors(10**12 + 1) == "a divisor of 1000000000001"


def test_interleaved_1f1b_without_virtual_stages_names_the_schedule_key():
    # The pipeline check said "virtual_stages=1 is invalid for interleaved_1f1b": the value, not the key that was set.
    cfg = load_config(ROOT / "configs/pipeline.yaml", ["parallel.pipeline_schedule=interleaved_1f1b"])
    with pytest.raises(ConfigError, match="parallel.virtual_stages=1 is invalid with "
                                          "parallel.pipeline_schedule=interleaved_1f1b"):
        check_layout(cfg, _sizes(cfg))


def test_distributed_without_a_cluster_exits_2_naming_the_key(tmp_path):
    # jax's cluster detection found nothing and raised ValueError('coordinator_address should be defined.'), printed
    # as a traceback. A fresh process: in this one jax is already running, and refuses for that reason instead.
    env = {k: v for k, v in cli_env().items() if not k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))}
    proc = subprocess.run([sys.executable, "-m", "spmd_train", "train", "configs/tiny.yaml", "run.distributed=true",
                           f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "run.distributed=true" in proc.stderr and "coordinator_address should be defined" in proc.stderr
    assert not (tmp_path / "run").exists()
