"""The precision policy's keys: precision.params / compute as model.param_dtype / compute_dtype under the policy's
names, and the recipes in precisions/ (`precision.preset`)."""

from dataclasses import asdict
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



def test_bfloat16_moments_stay_bfloat16_through_sharded_steps_and_track_float32_ones(devices):
    import jax
    import numpy as np

    from tests.runs import relative_error, run_steps

    ref, ref_params, _, ref_state = run_steps(["mesh.fsdp=1"], devices[:1])
    got, params, _, state = run_steps(["precision.moments=bfloat16", "mesh.fsdp=4", "mesh.tensor=2"], devices)
    adam = state.opt_state[1][0]  # clipping's state, then AdamW's (scale_by_adam first)
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    ref_adam = ref_state.opt_state[1][0]
    # Rounded moments (bfloat16 keeps 8 bits): after three steps the first moment is within a few bfloat16 steps of
    # float32's and the parameters within 1.3e-3 (measured), where one step fewer is 0.23 away; step 1's loss is the
    # same (the moments enter from step 1's update on).
    assert relative_error(jax.tree.map(np.float32, adam.mu), ref_adam.mu) < 2e-2
    assert relative_error(params, ref_params) < 5e-3 and got[0] == pytest.approx(ref[0], rel=1e-6)


def test_a_run_resumes_under_another_precision_policy_and_back(devices, tmp_path):
    """bfloat16 parameters trained 2 steps without a master copy or a loss scale, resumed with both for a third step,
    then without them again for a fourth: the state is carried over (a master copy from the stored parameters, the
    moments cast to float32, a fresh scale), the first step after the change has the uninterrupted run's loss (the
    forward pass reads the same parameters), and nothing is set aside as damaged."""
    import jax
    import numpy as np

    from spmd_train import Trainer, train
    from spmd_train.train.loss_scale import LossScaleState
    from spmd_train.train.master_weights import MasterState

    base = ["train.seq_len=16", "mesh.fsdp=1", "mesh.tensor=1", "run.simulate_devices=1", "precision.params=bfloat16"]
    config = lambda run, steps, *more: load_config(ROOT / "configs/tiny.yaml", [*base, f"run.dir={run}",
                                                                                 f"train.steps={steps}", *more])
    straight = train(config(tmp_path / "straight", 4), devices[:1]).history
    train(config(tmp_path / "changed", 2), devices[:1])
    trainer = Trainer(config(tmp_path / "changed", 3, "precision.master=float32", "precision.loss_scale=dynamic"),
                      devices[:1])
    try:
        state = trainer.init()
        assert isinstance(state.opt_state, LossScaleState) and float(state.opt_state.scale) == 2.0**16
        inner = state.opt_state.inner
        assert isinstance(inner, MasterState)
        for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(inner.master), strict=True):
            np.testing.assert_array_equal(np.asarray(m), np.asarray(p, np.float32))
        assert {x.dtype for x in jax.tree.leaves(inner.inner[1][0].mu)} == {np.dtype("float32")}
        third = trainer.run()
        after_third = jax.device_get(trainer.state.params)
    finally:
        trainer.close()
    fourth = train(config(tmp_path / "changed", 4), devices[:1]).history
    losses = lambda records: {r["step"]: r["loss"] for r in records if r["step"] > 2}
    got, want = {**losses(third), **losses(fourth)}, losses(straight)
    assert got[3] == want[3]  # the same parameters, bitwise
    # Step 3's update ran on the master copy (not rounded to bfloat16 before it lands), so step 4 reads parameters a
    # rounding apart: 5e-6 relative here.
    assert got[4] == pytest.approx(want[4], rel=1e-4)
    assert not (tmp_path / "changed" / "damaged_checkpoints").exists()
    # A new run takes the parameters of step 3 (saved with the master copy and the scale) into a plain policy.
    fresh = train(config(tmp_path / "fresh", 1, f"checkpoint.load_from={tmp_path / 'changed' / 'checkpoints' / '3'}",
                         "optim.lr=0"), devices[:1])
    assert type(fresh.state.opt_state) is tuple  # plain AdamW state: no master copy, no scale
    for a, b in zip(jax.tree.leaves(fresh.state.params), jax.tree.leaves(after_third), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_policy_change_is_measured_on_the_stored_moments():
    from spmd_train.train.policy_change import changes

    def saved(*overrides):
        return {"config": asdict(load_config(None, list(overrides)))}

    assert changes(saved(), load_config(None, ["precision.moments=bfloat16"])) == ["moments: float32 -> bfloat16"]
    assert changes(saved(), load_config(None, ["precision.moments=float32"])) == []  # null: float32 parameters'
    assert changes(saved("precision.preset=bf16-master"),
                   load_config(None, ["precision.preset=bf16-master", "precision.moments=float32"])) == []
    assert changes({"config": {"model": {}}}, load_config(None, [])) == []  # a checkpoint from before the section
    assert changes(saved("precision.loss_scale=dynamic"), load_config(None, [])) == ["precision.loss_scale: dynamic "
                                                                                     "-> none"]


def test_the_engine_reports_the_policy_in_effect_and_describe_prints_it(devices):
    from spmd_train import Engine
    from spmd_train.analysis.render import precision_line

    engine = Engine.build(load_config(None, ["precision.preset=bf16-master", "precision.matmul=fp8"]), devices)
    policy = engine.resolved()["precision"]
    assert policy == {"params": "bfloat16", "compute": "bfloat16", "matmul": "fp8", "moments": "float32",
                      "master": "float32", "loss_scale": "none", "reduce": "bfloat16"}  # moments: null, float32
    # over the master copy; reduce: null, the compute dtype's
    assert precision_line(policy) == ("precision: parameters bfloat16, compute bfloat16, optimizer moments float32, "
                                      "master copy float32, FP8 matmuls (e4m3 / e5m2)")
    assert precision_line({**policy, "matmul": "default", "reduce": "float32"}).endswith(
        "master copy float32, gradients summed in float32")


def test_a_run_resumes_with_another_compute_dtype_but_not_another_parameter_dtype():
    from spmd_train.train.checkpoint import check_same_model

    saved = {"config": asdict(load_config(None, ["precision.compute=bfloat16"]))}
    # The state is stored in the parameters' dtype whatever the matmuls run in.
    check_same_model(saved, load_config(None, ["precision.preset=mixed-fp16"]), "here")
    with pytest.raises(ConfigError, match=r"model.param_dtype: checkpoint 'float32', this run 'bfloat16'"):
        check_same_model(saved, load_config(None, ["precision.params=bfloat16"]), "here")
