"""`inference.streaming`: a completion streamed as Server-Sent Events, read as clients read
it (the official `openai` client, and the raw bytes on the wire), against the same request
answered at once."""

import json
import re

import httpx2 as httpx

from live_server import KEY, client, llm, solo, url  # noqa: F401 (fixtures)


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


SSE = re.compile(r"(?:data: (\{[^\n]*\})\n\n)+data: \[DONE\]\n\n")


def test_a_stream_is_sse_events_ending_with_done_on_the_wire(url):
    """The bytes of a stream: `data: {json}` events, each ended by a blank line, and
    `data: [DONE]` last (the `openai` client does not mind a missing [DONE]; a browser's
    reader or another client may wait for it)."""
    body = {"prompt": ["AB", "CD"], "max_tokens": 12, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        wire = r.read().decode()
    assert SSE.fullmatch(wire), wire[-300:]
    events = [json.loads(e) for e in re.findall(r"^data: (\{.*\})$", wire, re.M)]
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 48
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]
