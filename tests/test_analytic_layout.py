"""One analytic model for `describe` and `plan`: an engine hands over the very layout the planner labels, and both
commands print the same memory parts and collective terms for it."""

import json

import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis.analytic import analytic_layout
from spmd_train.analysis.plan import Candidate, Workload
from spmd_train.analysis.plan.labels import config_for, label, overrides
from tests.runs import main_in_process

LAYOUTS = [
    ("configs/tiny.yaml", Candidate(fsdp=4, tensor=2, remat="full", sequence_parallel=True, grad_accum=2)),
    ("configs/tiny.yaml", Candidate(data=2, fsdp=2, sequence=2, context_parallel="ring", zero_stage=2)),
    ("configs/pipeline.yaml", Candidate(pipeline=2, fsdp=2, tensor=2, pipeline_schedule="interleaved_1f1b",
                                    virtual_stages=2, pipeline_microbatches=4, dcn={"pipeline": 2})),
    ("configs/moe.yaml", Candidate(fsdp=2, expert=4, remat="save_matmuls", zero_stage=1)),
]


@pytest.mark.parametrize(("path", "candidate"), LAYOUTS, ids=[label(c) for _, c in LAYOUTS])
def test_an_engine_hands_over_the_layout_the_planner_labels(devices, path, candidate):
    # `plan --write-config` writes `config_for`; the engine built from it must be the candidate the plan ranked.
    cfg = config_for(load_config(path), candidate)
    layout = analytic_layout(Engine.build(cfg, devices))
    assert layout.candidate == candidate
    assert layout.workload == Workload.from_config(cfg, "cpu") and layout.workload.xla_cpu


@pytest.mark.tpu_aot
def test_describe_and_plan_explain_print_the_same_memory_parts_and_collectives(capsys):
    c = Candidate(fsdp=4, tensor=2, remat="full", sequence_parallel=True, grad_accum=2)
    code, out, err = main_in_process("describe", "configs/tiny.yaml", *overrides(c), "--topology", "v5e:2x4",
                                     "--json", capsys=capsys)
    assert code == 0, err
    described = json.loads(out)["analytic"]
    code, out, err = main_in_process("plan", "configs/tiny.yaml", "--topology", "v5e:2x4", "--explain", label(c),
                                     "--json", capsys=capsys)
    assert code == 0, err
    explained = json.loads(out)
    assert not described["xla_cpu"]  # libtpu's partitioning, as the plan for a v5e slice assumes
    assert described["memory"] == explained["memory"]
    assert described["collectives"] == explained["comm"]
    assert {t["axes"][0] for t in described["collectives"]} == {"fsdp", "tensor"}
