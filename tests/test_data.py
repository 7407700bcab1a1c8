"""Data sources: exact loss floors, determinism, per-host shares, token files, text and their errors."""

import json

import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.data import MarkovChain, TokenFiles, host_rows, prepare_data
from spmd_train.errors import ConfigError


def test_markov_floor_matches_the_empirical_entropy():
    chain = MarkovChain(16, 63, 256, order=1, concentration=0.5, seed=3)
    # Monte Carlo estimate of E[-log p(x_t | x_t-1)] over sampled batches.
    nll = []
    for step in range(8):
        tokens = chain.global_batch_array(step)
        probs = chain.transitions[tokens[:, :-1], tokens[:, 1:]]
        nll.append(-np.log(probs).mean())
    assert np.mean(nll) == pytest.approx(chain.loss_floor, rel=0.01)
    assert chain.loss_floor == pytest.approx(chain.entropy_rate)  # order 1: every target has its full context


def test_markov_order_two_floor_accounts_for_the_first_target():
    chain = MarkovChain(8, 15, 64, order=2, concentration=1.0, seed=1)
    assert chain.loss_floor > chain.entropy_rate  # target 1 sees one token of a two-token context
    nll = []
    for step in range(40):
        t = chain.global_batch_array(step)
        stationary = chain.stationary.reshape(8, 8)
        first = -np.log(stationary[t[:, 0], t[:, 1]] / stationary[t[:, 0]].sum(1))
        rest = -np.log(chain.transitions[t[:, :-2] * 8 + t[:, 1:-1], t[:, 2:]])
        nll.append((first.sum() + rest.sum()) / (t.shape[0] * 15))
    assert np.mean(nll) == pytest.approx(chain.loss_floor, rel=0.02)


def test_batches_are_a_function_of_seed_and_step():
    a, b = (MarkovChain(64, 32, 8, seed=7) for _ in range(2))
    np.testing.assert_array_equal(a.global_batch_array(5), b.global_batch_array(5))
    assert not np.array_equal(a.global_batch_array(5), a.global_batch_array(6))
    assert not np.array_equal(a.global_batch_array(5), MarkovChain(64, 32, 8, seed=8).global_batch_array(5))
    assert not np.array_equal(a.global_batch_array(5, "train"), a.global_batch_array(5, "val"))


def test_each_host_reads_a_disjoint_share_that_makes_the_global_batch(devices):
    # Pretend the 8 devices belong to 4 hosts of 2: each host's rows come from its devices.
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "tensor"))
    sharding = NamedSharding(mesh, P("data", None))
    per_host = []
    for host in range(4):
        host_devices = set(mesh.devices[host])
        spans = {idx[0].indices(32)[:2] for d, idx in sharding.devices_indices_map((32, 9)).items()
                 if d in host_devices}
        per_host.append(np.concatenate([np.arange(a, b) for a, b in sorted(spans)]))
    assert sorted(np.concatenate(per_host).tolist()) == list(range(32))  # disjoint and complete
    assert all(len(rows) == 8 for rows in per_host)
    np.testing.assert_array_equal(host_rows(sharding, (32, 9)), np.arange(32))  # one process holds all here
    chain = MarkovChain(64, 8, 32, seed=2)
    full = chain.global_batch_array(3)
    np.testing.assert_array_equal(np.concatenate([chain.rows(3, r) for r in per_host]), full[np.concatenate(per_host)])


def _write_bin(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype).tofile(path)
    return str(path)


def test_token_files_windows_come_from_the_file(tmp_path):
    stream = np.arange(5000) % 300
    path = _write_bin(tmp_path / "a.bin", stream)
    source = TokenFiles([path], seq_len=16, global_batch=8, seed=0, val_fraction=0.1, vocab_size=512)
    batch = source.global_batch_array(0)
    assert batch.shape == (8, 17)
    for row in batch:  # every window is a contiguous slice of the stream
        assert np.all(np.diff(row.astype(np.int64)) % 300 == 1)
    train_starts = {int(np.where(stream == r[0])[0][0]) for r in batch}
    assert max(train_starts) < 4500  # the last 10% is held out
    np.testing.assert_array_equal(batch, TokenFiles([path], seq_len=16, global_batch=8, seed=0,
                                                    val_fraction=0.1).global_batch_array(0))


def test_prepare_data_and_text_source(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.txt").write_text("héllo wörld " * 50)
    out = prepare_data([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out")
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["vocab_size"] == 257 and meta["num_documents"] == 2 and meta["dtype"] == "uint16"
    data = np.fromfile(out, np.uint16)
    assert bytes(data[:12].astype(np.uint8)) == b"hello world "
    # Each document ends with the byte tokenizer's end-of-text id, 256.
    assert len(data) == meta["num_tokens"] == 600 + 1 + len(("héllo wörld " * 50).encode()) + 1
    assert data[600] == data[-1] == 256
    np.testing.assert_array_equal(np.load(out.with_suffix(".docs.npy")), [0, 601])
    # Without packing every window lies inside one document.
    unpacked = TokenFiles([str(out)], seq_len=32, global_batch=16, seed=1, packing=False, val_fraction=0.0)
    for step in range(5):
        for row in unpacked.global_batch_array(step):
            text = bytes(row.astype(np.uint8)).decode("utf-8", errors="replace")
            assert ("hello" in text) != ("héllo" in text or "wörld" in text)
    text = TokenFiles([str(tmp_path / "a.txt")], seq_len=8, global_batch=4, text=True, val_fraction=0.0)
    assert text.vocab_size == 256
    window = bytes(text.global_batch_array(0)[0].astype(np.uint8))
    assert len(window) == 9 and window in b"hello world " * 3


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: TokenFiles([str(d / "missing.bin")], 8, 2), "does not exist"),
        (lambda d: TokenFiles([str(d / "empty.bin")], 8, 2), "empty.bin is empty"),
        (lambda d: TokenFiles([str(d / "short.bin")], 64, 2), "short.bin has 20 tokens"),
        (lambda d: TokenFiles([str(d / "odd.bin")], 8, 2), "not a whole number of uint16"),
        (lambda d: TokenFiles([str(d / "nomatch*.bin")], 8, 2), "matches no file"),
        (lambda d: TokenFiles([str(d / "short.bin")], 8, 2, vocab_size=16), "model.vocab_size=16"),
        # Without a sidecar the ids themselves are read: the largest is named.
        (lambda d: TokenFiles([str(d / "bare.bin")], 8, 2, vocab_size=300),
         "bare.bin holds token id 300, but model.vocab_size=300"),
        (lambda d: TokenFiles([str(d / "a.txt")], 1, 1, vocab_size=300), "it looks like text"),
        (lambda d: prepare_data([d / "empty.bin"], d / "o"), "empty.bin is empty"),
        (lambda d: prepare_data([d / "a.txt"], d / "o", tokenizer="wordpiece"), "valid: byte, tiktoken"),
        (lambda d: TokenFiles([str(d / "badjson.bin")], 8, 2), "badjson.json cannot be read (JSONDecodeError"),
        (lambda d: TokenFiles([str(d / "baddocs.bin")], 8, 2), "baddocs.docs.npy cannot be read (ValueError"),
        (lambda d: TokenFiles([str(d / "unsorted.bin")], 8, 2), "document starts must increase from 0"),
        (lambda d: TokenFiles([str(d / "short.bin")], 8, 2, token_dtype="uint32"),
         "data.token_dtype=uint32 contradicts short.json, which records uint16 tokens"),
    ],
    ids=["missing", "empty", "too-short", "odd-bytes", "no-match", "vocab", "bare-ids", "text-as-tokens",
         "prepare-empty", "tokenizer", "corrupt-meta", "corrupt-docs", "unsorted-docs", "dtype-conflict"],
)
def test_bad_data_is_a_clear_error_naming_the_file(tmp_path, make, needle):
    (tmp_path / "empty.bin").write_bytes(b"")
    _write_bin(tmp_path / "short.bin", np.arange(20))
    (tmp_path / "short.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 300}))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "a.txt").write_text("text")
    _write_bin(tmp_path / "bare.bin", [*range(40), 300, 7])
    for name in ("badjson", "baddocs", "unsorted"):
        _write_bin(tmp_path / f"{name}.bin", np.arange(40))
    (tmp_path / "badjson.json").write_text('{"dtype": "uint16", "vocab')  # cut short
    (tmp_path / "baddocs.docs.npy").write_bytes(b"\x93NUMPY garbage")
    np.save(tmp_path / "unsorted.docs.npy", np.array([0, 20, 10]))
    with pytest.raises(ConfigError, match=None) as err:
        make(tmp_path)
    assert needle in str(err.value)


def test_seq_len_longer_than_every_document_without_packing(tmp_path):
    (tmp_path / "a.txt").write_text("short doc")
    (tmp_path / "b.txt").write_text("another short one")
    out = prepare_data([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "o")
    with pytest.raises(ConfigError, match="longer than every document"):
        TokenFiles([str(out)], seq_len=20, global_batch=2, packing=False, val_fraction=0.0)
    TokenFiles([str(out)], seq_len=20, global_batch=2, packing=True, val_fraction=0.0)  # packing spans documents
