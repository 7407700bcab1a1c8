"""The precision policy's keys: precision.params / compute as model.param_dtype / compute_dtype under the policy's
names, and the recipes in precisions/ (`precision.preset`)."""

from pathlib import Path

import pytest
import yaml

from spmd_train import load_config
from spmd_train.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "precisions").glob("*.yaml"))


def _policy(cfg):
    return (cfg.model.param_dtype, cfg.model.compute_dtype, cfg.precision.master, cfg.precision.loss_scale)


def test_either_name_sets_the_one_setting_and_loaded_configs_hold_it_under_both():
    assert _policy(load_config(None, ["precision.compute=bfloat16"]))[:2] == ("float32", "bfloat16")
    for overrides in (["precision.params=bfloat16"], ["model.param_dtype=bfloat16"]):
        cfg = load_config(None, overrides)
        assert cfg.precision.params == cfg.model.param_dtype == "bfloat16"
        assert cfg.precision.compute == cfg.model.compute_dtype == "float32"
    load_config(None, ["precision.params=bfloat16", "model.param_dtype=bfloat16"])  # the same value twice
    with pytest.raises(ConfigError, match=r"precision.compute=bfloat16 and model.compute_dtype=float32 are one "
                                          r"setting under two names"):
        load_config(None, ["precision.compute=bfloat16", "model.compute_dtype=float32"])


@pytest.mark.parametrize("name", RECIPES)
def test_each_shipped_recipe_loads_as_its_file_says(name):
    keys = yaml.safe_load((ROOT / "precisions" / f"{name}.yaml").read_text())["precision"]
    cfg = load_config(None, [f"precision.preset={name}"])
    assert _policy(cfg) == (keys["params"], keys["compute"], keys["master"], keys["loss_scale"])


def test_the_recipes_are_the_documented_ones_and_a_key_given_beside_a_recipe_wins():
    assert RECIPES == ["bf16-master", "fp16-master", "fp32", "mixed-bf16", "mixed-fp16"]
    cfg = load_config(None, ["precision.preset=bf16-master", "model.compute_dtype=float32"])
    assert _policy(cfg) == ("bfloat16", "float32", "float32", "none")
    cfg = load_config(None, ["precision.preset=mixed-fp16", "precision.loss_scale_init=1024"])
    assert _policy(cfg) == ("float32", "float16", "none", "dynamic") and cfg.precision.loss_scale_init == 1024
    with pytest.raises(ConfigError, match="precision.preset='fp8' is not a known preset; valid presets: bf16-master, "
                                          "fp16-master, fp32, mixed-bf16, mixed-fp16"):
        load_config(None, ["precision.preset=fp8"])
    # A recipe whose keys cannot train together is refused as those keys given directly are.
    with pytest.raises(ConfigError, match=r"model.compute_dtype \(precision.compute\)=float16 needs precision.loss"):
        load_config(None, ["precision.preset=mixed-fp16", "precision.loss_scale=none"])


def test_a_saved_config_holding_both_names_takes_an_override_of_either(tmp_path):
    saved = tmp_path / "config.yaml"  # as a run writes it: the effective dtype under both names
    saved.write_text(yaml.safe_dump({"model": {"compute_dtype": "float32"}, "precision": {"compute": "float32"}}))
    assert load_config(saved, ["model.compute_dtype=bfloat16"]).precision.compute == "bfloat16"
    assert load_config(saved, ["precision.compute=bfloat16"]).model.compute_dtype == "bfloat16"
    assert load_config(saved).model.compute_dtype == "float32"

