"""`inference.api`: the OpenAI shapes of a response, from an engine's `RequestOutput`."""

from inference import api
from inference.detokenize import RequestOutput


class BytePieces:
    """A byte-level BPE's decode of single tokens: ids 1 and 2 are each part of one UTF-8
    character, so each alone decodes to the replacement character."""

    def decode(self, ids):
        return "".join({0: "a", 1: "\ufffd", 2: "\ufffd", 3: "b"}[i] for i in ids)


def test_top_logprobs_keyed_by_text_keep_the_best_of_tokens_with_the_same_text():
    """Fault (issue 41): several top tokens decode to the same text ("\\ufffd" for partial
    bytes); the text-keyed map kept the last, worst one's logprob. The best must win, in
    whichever order the alternatives come."""
    ranked = {1: -0.5, 0: -1.0, 2: -3.0}  # the engine's order: best first
    worst_first = {2: -3.0, 3: -4.0, 1: -0.25}
    out = RequestOutput("r", 0, [1, 3], [1, 3], True, "length", 0, "\ufffdb", "\ufffdb",
                        [-0.5, -4.0], [ranked, worst_first])
    lp = api.logprobs(BytePieces(), out, 0, 0)
    assert lp["top_logprobs"] == [{"\ufffd": -0.5, "a": -1.0}, {"\ufffd": -0.25, "b": -4.0}]
    assert lp["tokens"] == ["\ufffd", "b"] and lp["text_offset"] == [0, 1]
