"""Small local tokenizers for prompt-rule tests: byte-level, with and without a BOS-adding post-processor."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|end|>", "<|assistant|>"]


def byte_tokenizer(*, adds_bos: bool, chat: bool = False):
    """One token per byte (ids 6..261) after six special tokens (``<s>`` = 1 is the BOS, ``</s>`` = 2).

    ``adds_bos``: the post-processor puts ``<s>`` in front of every text encoded with special tokens,
    as Llama 3's and Gemma's tokenizers do. ``chat``: a chat template that writes the BOS itself.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


VOCAB = len(SPECIALS) + 256
"""Vocabulary size a tiny model needs for :func:`byte_tokenizer`."""


@pytest.fixture
def make_tokenizer():
    """:func:`byte_tokenizer` as a fixture (test modules cannot import this file)."""
    return byte_tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer (from the converted default model; its BOS is ``<|im_start|>``)."""
    import transformers

    from polykv.models import cached_model_dir, load_default_model

    folder = cached_model_dir()
    if not folder.is_dir():
        load_default_model()  # converts the installed GGUF once and caches it (offline)
    return transformers.AutoTokenizer.from_pretrained(str(folder))
