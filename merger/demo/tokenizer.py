"""A word-level tokenizer for the demo world, callable like open_clip's tokenizers.

Ids: 0 = padding, 1 = unknown word, 2.. = the world's words in sorted order, then SOT, then EOT as
the HIGHEST id: open_clip's text tower pools the token at ``argmax(token id)`` by default, so EOT
must out-rank every word for the pooled position to be the end of the sentence.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch

from merger.demo.world import vocabulary_words

CONTEXT_LENGTH = 24  # longest caption is ~20 words + SOT + EOT
_WORD = re.compile(r"[a-z]+")


class DemoTokenizer:
    """``tok(["a red circle."]) -> LongTensor [B, context_length]`` (SOT words... EOT, 0-padded)."""

    PAD, UNK = 0, 1

    def __init__(self, context_length: int = CONTEXT_LENGTH):
        self.context_length = context_length
        self.words: tuple[str, ...] = tuple(vocabulary_words())
        self.word_to_id = {w: i + 2 for i, w in enumerate(self.words)}
        self.sot_token_id = len(self.words) + 2
        self.eot_token_id = self.sot_token_id + 1
        self.vocab_size = self.eot_token_id + 1

    def encode(self, text: str) -> list[int]:
        """Word ids of one string (lower-cased; punctuation dropped), without SOT/EOT."""
        return [self.word_to_id.get(w, self.UNK) for w in _WORD.findall(text.lower())]

    def decode(self, ids: Iterable[int]) -> str:
        """Inverse of ``encode`` (special tokens and padding are skipped)."""
        inv = {v: k for k, v in self.word_to_id.items()}
        return " ".join(inv.get(int(i), "<unk>") for i in ids
                        if int(i) not in (self.PAD, self.sot_token_id, self.eot_token_id))

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        ctx = context_length or self.context_length
        out = torch.zeros(len(texts), ctx, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = [self.sot_token_id] + self.encode(text)[: ctx - 2] + [self.eot_token_id]
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out
