"""walk37 #8: a completion choice's log-prob ``text_offset`` is a running sum of the tokens' lengths (a sum per
prefix took seconds at 16k tokens), each offset where the token's text starts in the joined text."""

import random

from areno.types import GenerationOutput, SamplingParams
from areno.workflows.openai_client import ArenoAsyncOpenAI


class _Piece(str):
    """A token's text that counts how often its length is read."""

    reads = 0

    def __len__(self):
        _Piece.reads += 1
        return super().__len__()


class _PieceTokenizer:
    """Decodes one id to a piece of 0 to 3 characters (an empty piece: a byte of a split character)."""

    chat_template = None

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return _Piece("".join(self.pieces[i] for i in ids))


def _choice_logprobs(n, seed=0):
    rng = random.Random(seed)
    pieces = ["", "a", "bc", "déf", " ", "\n", "é"]
    tok = _PieceTokenizer(pieces)
    ids = [rng.randrange(len(pieces)) for _ in range(n)]
    out = GenerationOutput(
        request_id="x",
        prompt_ids=[1],
        output_ids=ids,
        output_logprobs=[-0.5] * n,
        output_versions=[0] * n,
        finish_reason="length",
    )
    client = ArenoAsyncOpenAI(None, tok, default_sampling=SamplingParams())
    return [pieces[i] for i in ids], client._completion_logprobs(out)


def test_text_offsets_are_where_each_token_starts_in_a_long_output():
    pieces, logprobs = _choice_logprobs(5000)
    text = "".join(pieces)
    assert logprobs["tokens"] == pieces
    expected, pos = [], 0
    for piece in pieces:
        expected.append(pos)
        pos += len(piece)
    assert logprobs["text_offset"] == expected
    assert all(text[o:].startswith(p) for o, p in zip(logprobs["text_offset"], pieces))
    assert logprobs["token_logprobs"] == [-0.5] * 5000 and len(logprobs["top_logprobs"]) == 5000


def test_text_offsets_read_each_tokens_length_once():
    _Piece.reads = 0
    _choice_logprobs(2000)
    assert _Piece.reads <= 2000  # a sum over every prefix read about n**2 / 2 = 2,000,000


def test_no_tokens_no_offsets():
    assert _choice_logprobs(0)[1]["text_offset"] == []
