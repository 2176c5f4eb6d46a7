"""The optional llguidance backend behind the same interface (skipped when llguidance is not installed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.config import StructuredOutputsConfig
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import StructuredOutputError, validate_structured_outputs
from tokenmill.structured_output.manager import make_backend

pytest.importorskip("llguidance")

EOS = 2
CFG = StructuredOutputsConfig(backend="guidance")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.model.default_model import default_model_path
    from tokenmill.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def backend(tokenizer):
    return make_backend(tokenizer, 49152, [EOS], CFG)


def allowed(bitmask, row):
    return set(np.flatnonzero(np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")).tolist())


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(regex="a(b"), "regex"),
    (StructuredOutputsParams(json={"type": "objec"}), "json"),
    (StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'), "structural_tag"),
])
def test_invalid_or_unsupported(backend, params, field):
    for check in (lambda: backend.compile(params), lambda: validate_structured_outputs(params, config=CFG)):
        with pytest.raises(StructuredOutputError) as ei:
            check()
        assert ei.value.field == field and str(ei.value).startswith(f"structured_outputs.{field}")


def test_json_mask_forced_tokens_refusal_and_eos(backend, tokenizer):
    m = backend.new_matcher(backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA),
                                                                    disable_any_whitespace=True)))
    forced = m.forced_tokens(8)
    assert tokenizer.decode(forced).startswith('{"') and m.validate_tokens(forced) == len(forced)
    assert m.accept_tokens(forced) == len(forced)
    text = tokenizer.decode(forced)
    rest = tokenizer.encode('{"name":"Bob","age":3}'[len(text):], add_special_tokens=False)
    bad = tokenizer.encode("]", add_special_tokens=False)
    assert m.accept_tokens(bad) == 0 and m.accept_tokens(rest) == len(rest)   # a refusal leaves no error state
    bm = backend.allocate_bitmask(2)
    m.fill_bitmask(bm, 1)
    assert allowed(bm, 1) == {EOS}
    assert m.is_terminated()        # llguidance stops once only the stop token may follow (the engine: 'stop')


def test_choice_regex_and_the_manager(tokenizer):
    import time

    from tokenmill.sampling_params import SamplingParams
    from tokenmill.structured_output.manager import StructuredOutputManager

    mgr = StructuredOutputManager(CFG, 49152, [EOS], tokenizer)

    class R:
        def __init__(self, rid, so):
            self.request_id, self.output_token_ids = rid, []
            self.sampling_params = SamplingParams(structured_outputs=so)

    reqs = [R("c", StructuredOutputsParams(choice=["yes", "no"])), R("r", StructuredOutputsParams(regex=r"[0-9]{2}"))]
    for r in reqs:
        mgr.add_request(r)
    for r in reqs:
        t0 = time.monotonic()
        while mgr.poll(r) is None:
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        assert mgr.poll(r) == "ready"

    class SR:
        def __init__(self, rid):
            self.req_id, self.spec_token_ids, self.sample = rid, [], True

    bm = mgr.grammar_bitmask(type("SO", (), {"scheduled": [SR("c"), SR("r")]})()).result()
    assert all(any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no")) for t in allowed(bm, 0))
    assert all(tokenizer.decode([t]).isdigit() for t in allowed(bm, 1))
    mgr.shutdown()
