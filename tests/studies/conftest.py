"""Offline tokenizers for task tests: whitespace, characters, and a byte-level BPE trained on the corpus."""

import pytest

from polykv.models.corpus import corpus_texts
from polykv.studies.tasks import CharTokenizer, WhitespaceTokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """A Hugging Face fast tokenizer (byte-level BPE, 2,000 merges) trained here on corpus prose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts("prose", 40, min_chars=500, seed=0), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(params=["whitespace", "char", "bpe"])
def tokenizer(request, bpe_tokenizer):
    return {"whitespace": WhitespaceTokenizer(), "char": CharTokenizer(), "bpe": bpe_tokenizer}[request.param]
