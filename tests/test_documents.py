"""Packed documents: segments and positions from the data, attention and the loss kept inside each document."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train import Engine, load_config
from spmd_train.config.model_schema import BackendsConfig, ModelConfig
from spmd_train.data import Batch, TokenFiles, make_source
from spmd_train.data.batch import document_layout, document_layout_from_eot
from spmd_train.errors import ConfigError
from spmd_train.ops.attention import dot_product_attention
from spmd_train.parallel.attention_backends.cudnn_backend import cudnn_attention
from spmd_train.parallel.backends import resolve_backends
from tests.runs import FP32, TINY, main_in_process, relative_error, run_steps, token_files, write_corpus
from tests.tiers import fast_cases


def test_document_layout_from_starts_restarts_positions_at_each_document():
    # Documents start at 0, 5, 7 and 12; the window [3, 11) begins inside the first.
    segments, positions = document_layout(np.array([0, 5, 7, 12]), 3, 8)
    np.testing.assert_array_equal(segments, [0, 0, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(positions, [0, 1, 0, 1, 0, 1, 2, 3])


def test_document_layout_from_eot_keeps_the_end_token_in_its_document():
    segments, positions = document_layout_from_eot(np.array([4, 9, 0, 9, 9, 3, 2]), eot_id=9)
    np.testing.assert_array_equal(segments, [0, 0, 1, 1, 2, 3, 3])
    np.testing.assert_array_equal(positions, [0, 1, 0, 1, 0, 0, 1])


def test_token_files_rows_carry_their_documents(tmp_path):
    path, docs = write_corpus(tmp_path, [5, 9, 3, 14, 7, 11, 6, 8] * 4)
    source = TokenFiles([str(path)], seq_len=16, global_batch=8, seed=3, val_fraction=0.0)
    assert source.documents  # packed token files mask documents by default
    tokens = source.global_batch_array(2)
    segments, positions = source.document_rows(2, np.arange(8))
    text = "".join(d + "\0" for d in docs)  # each document ends with id 256, read back as byte 0
    starts = np.cumsum([0] + [len(d) + 1 for d in docs])
    for row, seg, pos in zip(tokens, segments, positions, strict=True):
        offset = text.index(bytes(row.astype(np.uint8)).decode())
        doc = np.searchsorted(starts, offset + np.arange(17), side="right") - 1
        np.testing.assert_array_equal(seg, doc - doc[0])
        np.testing.assert_array_equal(pos[1:][seg[1:] != seg[:-1]], 0)  # each new document starts at 0
    assert segments.max() > 0  # windows do span documents


def test_without_packing_or_documents_no_segments_travel(tmp_path):
    path, _ = write_corpus(tmp_path, [40] * 8)
    assert not TokenFiles([str(path)], seq_len=16, global_batch=4, packing=False, val_fraction=0.0).documents
    assert not TokenFiles([str(path)], seq_len=16, global_batch=4, document_mask=False, val_fraction=0.0).documents


def _packed_rows(lengths_per_row, vocab, seed=0):
    """A Batch whose rows are documents of the given lengths back to back (each row sums to seq_len + 1)."""
    rng = np.random.default_rng(seed)
    tokens, segments, positions = [], [], []
    for lengths in lengths_per_row:
        tokens.append(rng.integers(0, vocab, sum(lengths)))
        segments.append(np.repeat(np.arange(len(lengths)), lengths))
        positions.append(np.concatenate([np.arange(n) for n in lengths]))
    return Batch(*(jnp.asarray(np.stack(a), jnp.int32) for a in (tokens, segments, positions)))


@pytest.mark.slow  # the fast tier checks documents through the sharded runs below
@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_packed_loss_is_the_loss_of_each_document_alone(devices, attention):
    # Larger weights than the default init: attention far from uniform, so crossing documents shows.
    cfg = load_config(None, [*TINY, *FP32, "mesh.fsdp=1", "model.init_std=0.3", f"backends.attention={attention}"])
    engine = Engine.build(cfg, devices[:1])
    params = engine.init_state().params
    lengths = [[7, 10], [3, 5, 9], [17], [1, 12, 4]]  # windows of seq_len + 1 = 17 tokens
    batch = _packed_rows(lengths, cfg.model.vocab_size)
    packed = float(jax.jit(engine.loss)(params, batch))
    total, scored = 0.0, 0
    for row, row_lengths in zip(np.asarray(batch.tokens), lengths, strict=True):
        for start, n in zip(np.cumsum([0, *row_lengths[:-1]]), row_lengths, strict=True):
            if n > 1:  # a document of one token has no target of its own
                alone = float(engine.loss(params, jnp.asarray(row[None, start:start + n])))
                total, scored = total + alone * (n - 1), scored + n - 1
    assert packed == pytest.approx(total / scored, rel=1e-6)
    # The equality is not automatic: attending across documents (the bare tokens) gives another loss.
    assert abs(float(engine.loss(params, batch.tokens)) - packed) > 1e-2 * packed


def test_cudnn_call_masks_documents_like_the_reference():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 12, 4, 16), (2, 12, 2, 16), (2, 12, 2, 16)))
    segments = jnp.asarray([[0] * 5 + [1] * 7, [0] * 2 + [1] * 4 + [2] * 6], jnp.int32)
    want = dot_product_attention(q, k, v, causal=True, segment_ids=segments)
    got = cudnn_attention(q, k, v, segments, implementation="xla")  # the same call cuDNN gets, run by XLA
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dtype", "head_dim", "chosen"), [("bfloat16", 64, "pallas"), ("float32", 64, "cudnn"),
                                                          ("bfloat16", 32, "cudnn")])
def test_auto_on_gpu_picks_kernels_that_take_segment_ids(dtype, head_dim, chosen):
    model = ModelConfig(num_layers=1, d_model=4 * head_dim, num_heads=4, num_kv_heads=4, d_ff=64, vocab_size=256,
                        compute_dtype=dtype)
    assert resolve_backends(model, BackendsConfig(), "gpu", documents=True).attention == chosen
    assert resolve_backends(model, BackendsConfig(), "gpu", documents=False).attention == "cudnn"


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_cudnn_asked_for_off_gpu_is_refused_before_anything_runs(platform):
    with pytest.raises(ConfigError, match=rf"backends.attention=cudnn needs NVIDIA GPUs .* devices are {platform} "
                                          r"\(valid here: auto, xla, pallas\)"):
        resolve_backends(ModelConfig(), BackendsConfig(attention="cudnn"), platform)


def _doc_run(corpus, overrides, devices, steps=3):
    return run_steps([*FP32, *token_files(corpus), *overrides], devices, steps=steps)


@pytest.fixture(scope="module")
def doc_reference(corpus, devices):
    losses, params, engine, _ = _doc_run(corpus, ["mesh.fsdp=1"], devices[:1])
    assert engine.cfg.data.masks_documents
    plain, _, _, _ = _doc_run(corpus, ["mesh.fsdp=1", "data.document_mask=false"], devices[:1], steps=1)
    assert abs(plain[0] - losses[0]) > 1e-4 * losses[0]  # the masks change the loss from the first step
    return losses, params


DOC_LAYOUTS = {
    "fsdp8_grad_accum4": ["mesh.fsdp=8", "train.grad_accum=4"],
    "data2_fsdp2_tensor2_sp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    "pipeline2_fsdp2_1f1b": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.data=2", "parallel.pipeline_schedule=1f1b",
                             "parallel.pipeline_microbatches=4"],
}


@pytest.mark.parametrize("layout", fast_cases(DOC_LAYOUTS, fast=["data2_fsdp2_tensor2_sp"]))
def test_sharded_runs_with_documents_equal_one_device(corpus, doc_reference, devices, layout):
    ref_losses, ref_params = doc_reference
    losses, params, _, _ = _doc_run(corpus, DOC_LAYOUTS[layout], devices)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(params, ref_params) <= 1e-5


def test_documents_reach_the_batch_the_engine_compiles(corpus, devices):
    cfg = load_config(None, [*TINY, *token_files(corpus)])
    engine = Engine.build(cfg, devices)
    batch = make_source(cfg).batch(0, engine.batch_sharding)
    abstract = engine.abstract_batch()
    assert batch.documents and abstract.documents
    for got, want in zip(batch, abstract, strict=False):
        if want is not None:
            assert (got.shape, got.sharding) == (want.shape, want.sharding)


def test_document_mask_without_documents_is_refused(tmp_path, capsys):
    raw = tmp_path / "raw.bin"
    np.arange(4000, dtype=np.uint16).tofile(raw)
    with pytest.raises(ConfigError, match=r"raw.bin marks no documents.*data\.eot_id"):
        TokenFiles([str(raw)], seq_len=16, global_batch=4, document_mask=True)
    # An end-of-document token marks them: a new document starts after each 9.
    tokens = np.array([1, 2, 9, 3, 4, 5, 9, 6] * 500, np.uint16)
    tokens.tofile(raw)
    source = TokenFiles([str(raw)], seq_len=7, global_batch=4, document_mask=True, eot_id=9, val_fraction=0.0)
    rows = source.global_batch_array(0)
    segments, _ = source.document_rows(0, np.arange(4))
    np.testing.assert_array_equal(segments[:, 1:] - segments[:, :-1], (rows[:, :-1] == 9).astype(int))
    code, _, err = main_in_process("train", "configs/tiny.yaml", "data.document_mask=true", "train.steps=1",
                                   f"run.dir={tmp_path / 'run'}", capsys=capsys)
    assert code == 2 and "Traceback" not in err
    assert "data.document_mask=true" in err and "data.source=markov" in err
