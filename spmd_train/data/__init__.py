"""Training data: Markov-chain tokens with a known loss floor, token files and raw text."""

from __future__ import annotations

from spmd_train.config.schema import Config
from spmd_train.data.batch import Batch, as_batch
from spmd_train.data.markov import MarkovChain
from spmd_train.data.prepare import prepare_data
from spmd_train.data.source import TokenSource, host_rows
from spmd_train.data.token_files import TokenFiles


def make_source(cfg: Config) -> TokenSource:
    """The data source a config asks for (`data.source`)."""
    d, t = cfg.data, cfg.train
    if d.source == "markov":
        return MarkovChain(d.vocab_size or cfg.model.vocab_size, t.seq_len, t.global_batch_size, order=d.order,
                           concentration=d.concentration, seed=t.seed)
    return TokenFiles(list(d.paths), t.seq_len, t.global_batch_size, seed=t.seed, token_dtype=d.token_dtype,
                      val_fraction=d.val_fraction, packing=d.packing, text=d.source == "text",
                      vocab_size=cfg.model.vocab_size, document_mask=d.document_mask, eot_id=d.eot_id)


__all__ = ["Batch", "MarkovChain", "TokenFiles", "TokenSource", "as_batch", "host_rows", "make_source", "prepare_data"]
