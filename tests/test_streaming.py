"""`inference.streaming`: a completion streamed as Server-Sent Events, read as clients read
it (the official `openai` client, and the raw bytes on the wire), against the same request
answered at once."""

from serving import client, llm, solo  # noqa: F401 (fixtures)


def joined(stream) -> dict[int, dict]:
    """Each choice's text and logprobs fields, its chunks concatenated."""
    choices = {}
    for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [],
                                               "top_logprobs": [], "text_offset": []})
            got["text"] += c.text
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                got[name] += getattr(c.logprobs, name)
    return choices


def test_streamed_logprobs_join_to_the_response_with_n2_and_stop_strings(client, llm):
    """Fault (issue 41): a stream held back text that might start a stop string, and the
    next chunk's text_offset started at the characters sent, not at its first token's
    offset ([0, 0, 1, ...] for [0, 1, 2, ...]). Every field of a streamed choice joins to
    the response's, with n = 2 and stop strings that hold text back."""
    fields = dict(max_new_tokens=40, temperature=0.9, seed=11, n=2, logprobs=3)
    ref = solo(llm, "ABCD", **fields)
    # the second sample stops at its characters 10-12; the others never complete ('~' is
    # not in the vocabulary) but hold back whichever character ends a chunk
    stops = [ref[1].text[10:13]] + [c + "~" for c in sorted(set(ref[0].text + ref[1].text))]
    request = dict(model="tiny", prompt="ABCD", max_tokens=40, temperature=0.9, seed=11, n=2,
                   logprobs=3, stop=stops)
    whole = client.completions.create(**request)
    assert [c.finish_reason for c in whole.choices] == ["length", "stop"]
    streamed = joined(client.completions.create(**request, stream=True))
    assert sorted(streamed) == [0, 1]
    for c in whole.choices:
        assert streamed[c.index] == {"text": c.text} | {
            name: getattr(c.logprobs, name)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert c.logprobs.text_offset == list(range(len(c.logprobs.tokens)))  # 1 char each

