"""A small word-level tokenizer built offline with ``tokenizers`` (no file, no network).

Used by the tiny recipes and by ``random_weights`` builds of real recipes (whose tokenizer files are not
available without a checkpoint). The vocabulary covers colours, shapes, motions, directions and common
caption words; anything else maps to ``<unk>``.
"""

from __future__ import annotations

import functools
from typing import Final

from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel

SPECIAL_TOKENS: Final = ("<pad>", "</s>", "<unk>")

COLOURS: Final = ("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple", "white", "black",
                  "gray", "pink", "brown")
SHAPES: Final = ("square", "circle", "triangle", "ball", "box", "ring", "cross", "star", "disk", "bar")
MOTIONS: Final = ("moving", "moves", "rotating", "rotates", "spinning", "bouncing", "bounces", "sliding",
                  "falling", "rising", "drifting", "growing", "shrinking", "still", "static", "pan", "panning",
                  "zoom", "zooming")
DIRECTIONS: Final = ("left", "right", "up", "down", "clockwise", "counterclockwise", "diagonally", "across",
                     "toward", "away", "center", "top", "bottom", "corner", "slowly", "quickly", "fast", "slow")
SCENES: Final = ("camera", "over", "image", "photo", "astronaut", "coffee", "cat", "rocket", "coins", "moon",
                 "chelsea", "text", "page", "brick", "grass", "sky", "water", "background", "scene", "video",
                 "frame", "light", "dark", "bright", "large", "small", "big", "tiny", "two", "three", "one",
                 "many", "pattern", "stripes", "checkerboard", "gradient", "noise")
COMMON: Final = ("a", "an", "the", "and", "of", "on", "in", "with", "to", "from", "at", "is", "are", "it",
                 "its", "while", "then", "into", "onto", "around", "through", "by", "for", ",", ".", "motion",
                 "score", ":", "-", "low", "quality", "blurry", "distorted", "ugly", "static")


def vocabulary() -> dict[str, int]:
    """Token -> id. Special tokens first (``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2)."""
    words: list[str] = list(SPECIAL_TOKENS)
    for group in (COLOURS, SHAPES, MOTIONS, DIRECTIONS, SCENES, COMMON):
        for word in group:
            if word not in words:
                words.append(word)
    words.extend(str(i) for i in range(100) if str(i) not in words)
    return {w: i for i, w in enumerate(words)}


@functools.lru_cache(maxsize=1)
def _build_tokenizer_json() -> str:
    tok = Tokenizer(WordLevel(vocabulary(), unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return tok.to_str()


def build_local_tokenizer(max_length: int = 64):  # -> transformers.PreTrainedTokenizerFast
    """A ``PreTrainedTokenizerFast`` over :func:`vocabulary` (pads with id 0, appends ``</s>``)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_build_tokenizer_json()),
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
        padding_side="right",
    )
    return tokenizer


def vocab_size() -> int:
    return len(vocabulary())
