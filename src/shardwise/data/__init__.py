"""Training data: byte-level corpora and the data-parallel batch sampler."""

from shardwise.data.corpus import VOCAB_SIZE, Corpus, load_corpus
from shardwise.data.sampler import DistributedBatchSampler

__all__ = ["VOCAB_SIZE", "Corpus", "DistributedBatchSampler", "load_corpus"]
