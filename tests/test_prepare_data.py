"""`prepare-data`: streaming equals whole-file tokenization, JSONL documents, the byte separator, bounded memory."""

from __future__ import annotations

import gzip
import json
import re
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from spmd_train.cli.main import main
from spmd_train.data import TokenFiles, prepare_data
from spmd_train.data.prepare import load_tokenizer
from spmd_train.data.tokenizers import safe_cut
from spmd_train.errors import ConfigError

EOT = 256
# Multi-byte characters (2, 3 and 4 bytes), "\r\n" and a lone "\r": at chunk sizes 1 to 7 every
# one of them straddles some chunk boundary.
TEXT = "héllo wörld, 3€ per 🙂!\r\nline two\rline three\n" * 7


def _tokens(path) -> np.ndarray:
    return np.fromfile(path, np.uint16)


def _meta(path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def _jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_streamed_bytes_equal_the_whole_file_read_at_once(tmp_path, chunk):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(TEXT.encode())
    b.write_bytes("ünïcode 🙂🙂🙂 end".encode())
    out = prepare_data([a, b], tmp_path / "out", chunk_bytes=chunk)
    # The reference: each file read whole with Path.read_text (universal newlines), as bytes, then EOT.
    whole = [np.frombuffer(p.read_text(encoding="utf-8").encode(), np.uint8) for p in (a, b)]
    expected = np.concatenate([whole[0], [EOT], whole[1], [EOT]])
    np.testing.assert_array_equal(_tokens(out), expected)
    np.testing.assert_array_equal(np.load(out.with_suffix(".docs.npy")), [0, len(whole[0]) + 1])
    assert _meta(out)["num_tokens"] == len(expected) and _meta(out)["num_documents"] == 2


@pytest.mark.parametrize(("data", "chunk", "needle"), [
    (b"abc\xffdef", 2, "byte 3 (0xff): invalid start byte"),
    ("x€y".encode()[:3] + b"z", 2, "byte 1 (0xe2): invalid continuation byte"),  # € cut short, straddling chunks
    ("ab€".encode()[:4], 3, "byte 2 (0xe2): unexpected end of data"),  # the file ends inside a character
])
def test_bad_utf8_names_the_file_and_byte_across_chunks(tmp_path, data, chunk, needle):
    (tmp_path / "bad.txt").write_bytes(data)
    with pytest.raises(ConfigError, match=r"input .*bad.txt cannot be read as UTF-8 text: ") as err:
        prepare_data([tmp_path / "bad.txt"], tmp_path / "out", chunk_bytes=chunk)
    assert needle in str(err.value)
    assert not (tmp_path / "out").exists()


def test_jsonl_documents_and_their_starts(tmp_path):
    records = [{"text": "ab"}, {"text": ""}, {"text": "cde", "id": 7}, {"text": "🙂"}]
    _jsonl(tmp_path / "a.jsonl", records)
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write("\n   \n")  # blank lines are no documents
    (tmp_path / "b.txt").write_text("fg")
    out = prepare_data([tmp_path / "a.jsonl", tmp_path / "b.txt"], tmp_path / "out", chunk_bytes=1)
    smile = list("🙂".encode())
    np.testing.assert_array_equal(_tokens(out), [97, 98, EOT, 99, 100, 101, EOT, *smile, EOT, 102, 103, EOT])
    np.testing.assert_array_equal(np.load(out.with_suffix(".docs.npy")), [0, 3, 7, 12])
    meta = _meta(out)
    assert (meta["num_documents"], meta["empty_documents_skipped"], meta["text_field"]) == (4, 1, "text")
    # Gzipped, the same documents.
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write((tmp_path / "a.jsonl").read_text())
    zipped = prepare_data([tmp_path / "a.jsonl.gz", tmp_path / "b.txt"], tmp_path / "gz")
    np.testing.assert_array_equal(_tokens(zipped), _tokens(out))


def test_jsonl_documents_feed_document_masking(tmp_path):
    _jsonl(tmp_path / "d.jsonl", [{"body": "x" * n} for n in (5, 9, 3, 14, 7)])
    out = prepare_data([tmp_path / "d.jsonl"], tmp_path / "out", text_field="body")
    source = TokenFiles([str(out)], seq_len=8, global_batch=4, val_fraction=0.0, vocab_size=257)
    tokens = source.global_batch_array(0)
    segments, _ = source.document_rows(0, np.arange(4))
    for row, seg in zip(tokens, segments, strict=True):
        ends = np.flatnonzero(row[:-1] == EOT)  # the end id closes its document: the next token opens another
        np.testing.assert_array_equal(np.flatnonzero(np.diff(seg)), ends)


@pytest.mark.parametrize(("line", "needle"), [
    ("not json", "bad.jsonl:2: not JSON (Expecting value at column 1)"),
    ('["a list"]', "bad.jsonl:2: a JSON array, not an object with a string field 'text'"),
    ('{"content": "x", "id": 1}', "bad.jsonl:2: the object has no field 'text' (its keys: 'content', 'id'; "
                                  "valid: --text-field KEY"),
    ('{"text": 42}', "bad.jsonl:2: field 'text' is a JSON number, not a string"),
    ('{"text": null}', "bad.jsonl:2: field 'text' is a JSON null, not a string"),
    (b'{"text": "\xff"}', "bad.jsonl:2: not UTF-8 text (byte 10 of the line"),
], ids=["not-json", "not-object", "no-field", "number", "null", "not-utf8"])
def test_a_bad_jsonl_line_names_file_line_and_field(tmp_path, line, needle):
    raw = line if isinstance(line, bytes) else line.encode()
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n' + raw + b"\n")
    with pytest.raises(ConfigError) as err:
        prepare_data([tmp_path / "bad.jsonl"], tmp_path / "out")
    assert needle in str(err.value)
    assert not (tmp_path / "out").exists()


def test_inputs_without_any_text_are_refused(tmp_path):
    _jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(ConfigError, match=r"no document with text \(2 empty ones skipped\)"):
        prepare_data([tmp_path / "empty.jsonl"], tmp_path / "out")


def test_byte_documents_end_with_id_256_and_need_a_vocab_of_257(tmp_path):
    assert load_tokenizer("byte")[1:3] == (257, 256)
    for name, text in (("a.txt", "one"), ("b.txt", "two")):
        (tmp_path / name).write_text(text)
    out = prepare_data([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out")
    np.testing.assert_array_equal(_tokens(out), [*b"one", EOT, *b"two", EOT])
    assert (_meta(out)["vocab_size"], _meta(out)["eot_id"]) == (257, 256)
    with pytest.raises(ConfigError, match=re.escape("holds token ids up to 256, but model.vocab_size=256 "
                                                    "(valid: model.vocab_size >= 257)")):
        TokenFiles([str(out)], seq_len=2, global_batch=2, val_fraction=0.0, vocab_size=256)
    assert TokenFiles([str(out)], seq_len=2, global_batch=2, val_fraction=0.0, vocab_size=264).vocab_size == 257


def test_a_byte_file_written_before_the_separator_still_loads(tmp_path):
    # What older versions wrote: bytes only, vocab 256, no end id, documents from NAME.docs.npy.
    docs = [b"first document", b"second one"]
    np.frombuffer(b"".join(docs), np.uint8).astype(np.uint16).tofile(tmp_path / "old.bin")
    np.save(tmp_path / "old.docs.npy", np.array([0, len(docs[0])], np.int64))
    (tmp_path / "old.json").write_text(json.dumps({
        "dtype": "uint16", "vocab_size": 256, "tokenizer": "byte", "eot_id": None, "num_tokens": 24,
        "num_documents": 2, "inputs": ["a.txt", "b.txt"]}))
    source = TokenFiles([str(tmp_path / "old.bin")], seq_len=8, global_batch=4, val_fraction=0.0, vocab_size=256)
    assert source.vocab_size == 256 and source.documents
    segments, _ = source.document_rows(0, np.arange(4))
    for row, seg in zip(source.global_batch_array(0), segments, strict=True):
        offset = b"".join(docs).index(bytes(row.astype(np.uint8)))
        second = offset + np.arange(9) >= len(docs[0])  # where the second document's tokens are
        np.testing.assert_array_equal(seg, second.astype(int) - second[0])


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_host_memory_stays_a_small_multiple_of_the_chunk(tmp_path, kind):
    chunk, size = 64 << 10, 12 << 20  # an input ~200 chunks long
    line = "Some words, ünïcode and 🙂 to tokenize. " * 20
    lines = [line] * (size // len(line.encode()))
    path = tmp_path / f"big.{kind}"
    if kind == "text":
        path.write_text("\n".join(lines))
    else:
        _jsonl(path, [{"text": t} for t in lines])
    tracemalloc.start()
    try:
        out = prepare_data([path], tmp_path / "out", chunk_bytes=chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.stat().st_size > 2 * size  # the whole input went through (uint16: 2 bytes a byte)
    # Measured: 1.3 MiB (text, 4-byte characters) and 0.3 MiB (JSONL) at 64 KiB; at the default
    # 4 MiB, 21 MiB for ASCII and 42 MiB for 4-byte characters, whatever the input's size.
    assert peak < min(32 * chunk, size / 5), f"peak {peak / 2**20:.2f} MiB"


def test_safe_cut_places_cuts_between_words_only():
    text = "one two  three"
    assert safe_cut(text, "anywhere", 4) == (14, 14)
    assert safe_cut(text, "before_space", 100) == (3, 3)  # "two  three": a run of spaces is not cut
    assert safe_cut(text, "drop_space", 100) == (3, 4)
    assert safe_cut(text, "before_space", 5) == (14, 14)  # no cut within 5 characters of the end: cut at the end
    assert safe_cut("x" * 10, "before_space", 100) == (10, 10)
    assert safe_cut("a\n\n  word", "before_space", 100) == (9, 9)  # cl100k's \s++$ would see "\n\n " at a cut


# A text whose cuts land everywhere BPE pre-tokenization could notice: runs of spaces, newlines
# and spaces mixed, numbers, punctuation, contractions, non-Latin letters.
WORDS = ["the", "quick", "fox's", "  jumps", "over\n\n  the", "lazy", "dog.", "1234", "€5", "naïve", "日本語",
         "\tend", "it's", "(x)", "a", "\n"]


def _wordy_text(seed: int, n: int = 400) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n))


@pytest.mark.parametrize("encoding", ["r50k_base", "cl100k_base", "o200k_base"])
def test_tiktoken_pieces_tokenize_as_the_whole(tmp_path, monkeypatch, encoding):
    tiktoken = pytest.importorskip("tiktoken")
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    # The real pre-tokenization patterns over small made-up merges (no download): bytes, then
    # pairs and triples of the text's frequent characters.
    ranks = {bytes([i]): i for i in range(256)}
    for word in ("th", "the", " t", " th", " the", "  ", "\n\n", "\n\n ", "ju", "jum", "12", "123", "'s", " j"):
        ranks.setdefault(word.encode(), len(ranks))
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: dict(ranks))
    spec = getattr(openai_public, encoding)()
    specials = {"<|endoftext|>": len(ranks)}
    enc = tiktoken.Encoding(encoding, pat_str=spec["pat_str"], mergeable_ranks=spec["mergeable_ranks"],
                            special_tokens=specials)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc)
    texts = [_wordy_text(0), "the fox\n\n  jumps " * 40]  # the second: " jumps" after "\n\n " is no cut (cl100k)
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    out = prepare_data([tmp_path / "0.txt", tmp_path / "1.txt"], tmp_path / "out", tokenizer=f"tiktoken:{encoding}",
                       chunk_bytes=24)
    eot = len(ranks)
    np.testing.assert_array_equal(_tokens(out), [*enc.encode_ordinary(texts[0]), eot, *enc.encode_ordinary(texts[1]),
                                                 eot])


@pytest.mark.parametrize("options", [{}, {"remove_extra_whitespaces": False},
                                     {"add_dummy_prefix": False, "remove_extra_whitespaces": False}],
                         ids=["default", "keep-whitespace", "no-dummy-prefix"])  # the last: like Gemma's
def test_sentencepiece_pieces_tokenize_as_the_whole(tmp_path, options):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_wordy_text(seed, 30) for seed in range(50)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   hard_vocab_limit=False, character_coverage=1.0, minloglevel=2, **options)
    model = tmp_path / "sp.model"
    sp = spm.SentencePieceProcessor(model_file=str(model))
    text = _wordy_text(1)
    (tmp_path / "a.txt").write_text(text)
    out = prepare_data([tmp_path / "a.txt"], tmp_path / "out", tokenizer=f"sentencepiece:{model}", chunk_bytes=24)
    np.testing.assert_array_equal(_tokens(out), [*sp.encode(text), sp.eos_id()])


def _hf_tokenizer(directory: Path, style: str, texts: list[str]):
    """A small tokenizer.json trained here: byte-level BPE (Llama 3, Qwen) or Metaspace (Llama 2, Mistral)."""
    tk = pytest.importorskip("tokenizers")
    if style == "byte_level":
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = tk.decoders.Metaspace(prepend_scheme="first")
        trainer = tk.trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(texts, trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id("</s>")}))
    return tok


@pytest.mark.parametrize("style", ["byte_level", "metaspace"])
def test_hugging_face_tokenizer_pieces_tokenize_as_the_whole_and_end_with_eos(tmp_path, style):
    tok = _hf_tokenizer(tmp_path / "hf", style, [_wordy_text(seed, 30) for seed in range(50)])
    texts = [_wordy_text(1), "the fox jumps " * 30]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    out = prepare_data([tmp_path / "0.txt", tmp_path / "1.txt"], tmp_path / "out", tokenizer=f"hf:{tmp_path / 'hf'}",
                       chunk_bytes=24)
    eos = tok.token_to_id("</s>")
    whole = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    np.testing.assert_array_equal(_tokens(out), [*whole[0], eos, *whole[1], eos])
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["eot_id"] == eos and meta["vocab_size"] == tok.get_vocab_size()


def test_hugging_face_tokenizer_bad_input_is_named(tmp_path):
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        load_tokenizer(f"hf:{tmp_path}")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a tokenizers file"):
        load_tokenizer(f"hf:{tmp_path}")


def test_cli_prepares_jsonl_with_a_text_field(tmp_path, capsys):
    _jsonl(tmp_path / "d.jsonl", [{"content": "hello"}, {"content": "world!"}])
    assert main(["prepare-data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out"),
                 "--text-field", "content"]) == 0
    assert "wrote 13 tokens (2 documents, uint16, vocab 257)" in capsys.readouterr().out
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "data.docs.npy"), [0, 6])


def test_cli_bad_jsonl_line_exits_2_naming_it(tmp_path, capsys):
    _jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"body": "no text field"}])
    assert main(["prepare-data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:2: the object has no field 'text' (its keys: 'body'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_prepare_data_refuses_a_bad_out_and_leaves_nothing_half_written(tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("hello")
    bad.write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(ConfigError, match=r"--out .*afile is a file, not a directory"):
        prepare_data([good], tmp_path / "afile")
    with pytest.raises(ConfigError, match=r"--out .*afile/data cannot be created \(Not a directory\)"):
        prepare_data([good], tmp_path / "afile" / "data")
    with pytest.raises(ConfigError, match=r"b.txt cannot be read as UTF-8"):
        prepare_data([good, bad], tmp_path / "new")  # the second input fails after the first was written
    assert not (tmp_path / "new").exists()  # created by the call: removed again
    (tmp_path / "old").mkdir()
    with pytest.raises(ConfigError):
        prepare_data([good, bad], tmp_path / "old")
    assert list((tmp_path / "old").iterdir()) == []  # no .partial left in a directory that was there


def test_a_truncated_gzip_input_is_named(tmp_path):
    data = gzip.compress(b'{"text": "some text"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"input .*cut.jsonl.gz cannot be read \(EOFError"):
        prepare_data([tmp_path / "cut.jsonl.gz"], tmp_path / "out")


class _Fake:
    """A tokenizer package whose loading fails the way the real one does offline or on a bad name."""

    def __init__(self, error: Exception, names=("cl100k_base", "gpt2")):
        self.error, self.names = error, names

    def get_encoding(self, name):
        raise self.error

    def list_encoding_names(self):
        return list(self.names)

    def SentencePieceProcessor(self, model_file):
        raise self.error


@pytest.mark.parametrize(("package", "spec", "error", "needle"), [
    ("tiktoken", "tiktoken:cl100k", ValueError("Unknown encoding cl100k"),
     "tiktoken has no encoding 'cl100k' (valid: cl100k_base, gpt2)"),
    ("tiktoken", "tiktoken:gpt2", ConnectionError("Max retries exceeded"),
     "tiktoken could not load 'gpt2' (ConnectionError: Max retries exceeded); on a machine without network"),
    ("sentencepiece", "sentencepiece:{model}", RuntimeError("Internal: could not parse ModelProto"),
     "is not a SentencePiece model (Internal: could not parse ModelProto)"),
])
def test_a_tokenizer_that_cannot_be_loaded_is_a_clear_error(tmp_path, monkeypatch, package, spec, error, needle):
    monkeypatch.setitem(sys.modules, package, _Fake(error))
    model = tmp_path / "tok.model"
    model.write_text("not a model")
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_tokenizer(spec.format(model=model))
