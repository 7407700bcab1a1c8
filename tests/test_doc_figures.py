"""Figures the docs' prose restates from docs/benchmarks.md match the section the benchmark script wrote, so a
rerun that moves a figure fails here instead of leaving the prose quoting the old one. (Figures quoted from a
documented command's output are checked where the examples test runs it: tests/test_examples.py FIGURES.)"""

from __future__ import annotations

import re

from spmd_train import load_config
from spmd_train.analysis.stage_costs import stage_shares
from spmd_train.models.flops import balanced_depths
from tests.runs import ROOT

BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()


def _section(name: str) -> str:
    return re.search(rf"<!-- {name}:start -->(.*?)<!-- {name}:end -->", BENCHMARKS, re.S).group(1)


def _number(text: str) -> float:
    return float(text.split()[0])


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_the_pipeline_memory_table_in_docs_rounds_the_benchmark_section():
    bench: dict[tuple[str, str], dict[str, list[str]]] = {}
    for row in _rows(_section("pipeline_memory"))[1:]:
        model, where, schedule = row[0].split(",")[0], row[1].replace("8 x CPU", "8 simulated CPU devices"), row[2]
        bench.setdefault((model, where), {})[schedule] = row
    doc = (ROOT / "docs" / "pipeline.md").read_text()
    table = doc[doc.index("| model, tokens per microbatch |"):]
    table = table[:table.index("\n\n")]
    rows = _rows(table)[1:]
    assert len(rows) == 3
    for row in rows:
        model = re.split(r",| with ", row[0])[0]
        found = bench[model, row[1]]
        gpipe, one_f = found["gpipe"], found["1f1b"]
        for column, bench_column in ((2, 4), (3, 5), (5, 6)):  # stash, temporaries, total: "GPipe / 1F1B unit"
            quoted = [float(x) for x in row[column].split()[0:3:2]]
            measured = [_number(gpipe[bench_column]), _number(one_f[bench_column])]
            assert all(abs(q - m) <= 0.051 for q, m in zip(quoted, measured, strict=True)), (row, column, measured)
            assert row[column].split()[-1] == gpipe[bench_column].split()[-1]  # the same unit
        assert row[4] == one_f[7], (row, one_f)  # the ratio of temporaries


def test_the_128k_context_figure_in_docs_is_the_benchmark_sections():
    section = _section("context_memory")
    peak = re.search(r"llama3-8b_128k_v5p\.yaml` at full size .*?peak ([\d.]+ GiB) per chip", section, re.S).group(1)
    doc = (ROOT / "docs" / "context.md").read_text()
    quoted = re.findall(r"peak memory per chip ([\d.]+ GiB)|([\d.]+ GiB) per v5p chip", doc)
    quoted = [a or b for a, b in quoted]
    assert len(quoted) == 2 and set(quoted) == {peak}, (quoted, peak)


def test_the_zero_bubble_memory_ratios_in_docs_are_the_benchmark_sections():
    rows = {(row[1], row[2]): row[8] for row in _rows(_section("pipeline_zero_bubble"))[1:]}
    doc = (ROOT / "docs" / "pipeline.md").read_text()
    quoted = re.search(r"`zb_h1`'s step needs ([\d.]+)x the memory of 1F1B's and `zb_v`'s ([\d.]+)x", doc, re.S)
    assert quoted, "docs/pipeline.md no longer quotes the zero-bubble memory ratios"
    assert (quoted.group(1), quoted.group(2)) == (rows["TPU v5e:2x4", "zb_h1"], rows["TPU v5e:2x4", "zb_v"])


def test_the_stage_balance_table_in_docs_is_what_stage_costs_computes():
    text = (ROOT / "docs" / "pipeline.md").read_text()
    cells = r"^\| ([\w.-]+), (\d+) \| (\d+) \| ([\d, ]+) \| ([\d.]+) \| ([\d, ]+) \| ([\d.]+) \|$"
    rows = re.findall(cells, text, re.M)
    assert [r[0] for r in rows] == ["llama3-8b", "llama-1b", "gpt2-small"]
    for preset, seq, stages, even, even_ratio, best, best_ratio in rows:
        m, seq, p = load_config(None, [f"model.preset={preset}"]).model, int(seq), int(stages)
        parse = lambda cell: [int(x) for x in cell.split(", ")]
        assert parse(even) == [m.num_layers // p] * p and parse(best) == balanced_depths(m, seq, p)
        for depths, ratio in ((parse(even), even_ratio), (parse(best), best_ratio)):
            assert f"{max(stage_shares(m, seq, depths, p)) * p:.3f}" == ratio
