"""The xgrammar backend and the structured-output manager, on the default model's real tokenizer (no model)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from tokenmill.config import StructuredOutputsConfig
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output import StructuredOutputError, validate_structured_outputs
from tokenmill.structured_output.backend import constraint_key, disallow_additional_properties
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.xgrammar_backend import (
    XgrammarBackend, apply_bitmask_torch, apply_token_bitmask, MaskPlan, SparseRowsMask, row_runs,
)

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.model.default_model import default_model_path
    from tokenmill.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, 49152, [EOS], StructuredOutputsConfig())


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def walk(backend, tokenizer, params, text: str):
    """A matcher that accepted ``text`` tokenised by the model's tokenizer."""
    m = backend.new_matcher(backend.compile(params))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert m.accept_tokens(ids) == len(ids)
    return m


@pytest.mark.parametrize("params, field, needle", [
    (StructuredOutputsParams(regex="a(b"), "regex", "parenthesis"),
    (StructuredOutputsParams(json={"type": "objec"}), "json", "objec"),
    (StructuredOutputsParams(json="{not json"), "json", "not valid JSON"),
    (StructuredOutputsParams(grammar='root ::= "a" | '), "grammar", "EBNF"),
    (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?"), "whitespace_pattern", "not supported"),
])
def test_invalid_constraints_name_the_field(backend, params, field, needle):
    for check in (lambda: backend.compile(params), lambda: validate_structured_outputs(params)):
        with pytest.raises(StructuredOutputError) as ei:
            check()
        assert ei.value.field == field and ei.value.status_code == 400
        assert str(ei.value).startswith(f"structured_outputs.{field}") and needle in str(ei.value)
        assert "/project/cpp" not in str(ei.value)        # xgrammar's source-file prefix is stripped


def test_validate_accepts_good_constraints(tokenizer):
    for p in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"\d+"),
              StructuredOutputsParams(choice=['a"b', "c\\d", "é"]), StructuredOutputsParams(json_object=True),
              StructuredOutputsParams(grammar='root ::= "x" root | "y"')):
        validate_structured_outputs(p)
        validate_structured_outputs(p, tokenizer=tokenizer)


def test_choice_and_regex_masks(backend, tokenizer):
    m = walk(backend, tokenizer, StructuredOutputsParams(choice=['say "hi"', "no"]), 'say "h')
    bm = backend.allocate_bitmask(1)
    m.fill_bitmask(bm, 0)
    ok = allowed(bm, 0)
    assert tokenizer.encode('i"', add_special_tokens=False)[0] in ok and EOS not in ok
    m = walk(backend, tokenizer, StructuredOutputsParams(regex=r"[0-9]{3}"), "123")
    m.fill_bitmask(bm, 0)
    assert allowed(bm, 0) == {EOS}                 # complete: only the stop token may follow
    assert m.accept_token(EOS) and m.is_terminated()


def test_json_whitespace_and_additional_properties(backend, tokenizer):
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    m = walk(backend, tokenizer, compact, '{"name":')
    bm = backend.allocate_bitmask(1)
    m.fill_bitmask(bm, 0)
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    assert newline not in allowed(bm, 0)        # compact: xgrammar's separators ", " and ": " only
    loose = walk(backend, tokenizer, StructuredOutputsParams(json=SCHEMA), '{"name":')
    loose.fill_bitmask(bm, 0)
    assert newline in allowed(bm, 0)
    assert disallow_additional_properties({"type": "object", "properties": {"a": {"type": "object"}}}) == {
        "type": "object", "additionalProperties": False,
        "properties": {"a": {"type": "object", "additionalProperties": False}}}
    # the server's default and the request's flag share the cache key only when they agree
    assert constraint_key(compact) == constraint_key(StructuredOutputsParams(json=SCHEMA),
                                                     StructuredOutputsConfig(disable_any_whitespace=True))
    assert constraint_key(compact) != constraint_key(StructuredOutputsParams(json=SCHEMA))


def test_forced_tokens_are_the_forced_string(backend, tokenizer):
    m = walk(backend, tokenizer, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), "")
    forced = m.forced_tokens(8)
    # the whole forced string (compact separators ", " and ": "), as the model's tokenizer splits it
    assert tokenizer.decode(forced) == '{"name": "' and forced == tokenizer.encode('{"name": "', add_special_tokens=False)
    assert m.validate_tokens(forced) == len(forced)
    assert m.forced_tokens(1) == forced[:1]
    assert m.accept_tokens(forced) == len(forced)        # validate_tokens left the state unchanged
    assert m.forced_tokens(8) == [] or tokenizer.decode(m.forced_tokens(8)).startswith('"')


@pytest.mark.parametrize("vocab", [70, 100])     # 70: the last word partly padding; 100: logits wider
def test_apply_bitmask_matches_brute_force(vocab):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=g)
    full = torch.randint(-2**31, 2**31 - 1, (5, 3), generator=g, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    for row in (3, 1):
        for t in range(vocab):
            if t >= 96 or not (int(full[row, t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    got = logits.clone()
    apply_token_bitmask(got, full, [3, 1])              # the numpy path, rows index the full bitmask
    assert torch.equal(got, want)
    got = logits.clone()
    apply_token_bitmask(got, full, [3, 1], MaskPlan(full, [3, 1]))   # planned on the fill thread
    assert torch.equal(got, want)
    got = logits.clone()
    apply_bitmask_torch(got, full[[3, 1]], [3, 1])      # the torch path, compact bitmask rows
    assert torch.equal(got, want)
    # a run of consecutive rows (one copyto) and a non-contiguous logits tensor (the torch fallback)
    want_all = logits.clone()
    apply_bitmask_torch(want_all, full[[1, 2, 3]], [1, 2, 3])
    got = logits.clone()
    apply_token_bitmask(got, full, [1, 2, 3])
    assert torch.equal(got, want_all)
    wide = torch.cat([logits, logits], dim=1)
    view = wide[:, :vocab]
    apply_token_bitmask(view, full, [1, 2, 3])
    assert not view.is_contiguous() and torch.equal(view, want_all)
    assert row_runs([0, 1, 2, 5, 7, 8]) == [(0, 3, 0), (5, 6, 3), (7, 9, 4)]


@pytest.mark.parametrize("vocab", [70, 100, 200])   # padding inside the last word, logits wider, exact width
def test_apply_bitmask_sparse_rows_match_brute_force(vocab):
    """Rows that allow few tokens (the plan's gather / fill / scatter, in runs of consecutive rows) and dense
    rows mixed, each row as the per-token rule says; also a row allowing nothing and one allowing all."""
    g = torch.Generator().manual_seed(1)
    words = 7
    bits = torch.rand(8, 32 * words, generator=g) < 0.5                           # dense rows
    for r, n in ((0, 3), (1, 1), (2, 0), (4, 5), (6, 2)):                          # sparse rows, n allowed
        bits[r] = False
        bits[r, torch.randperm(32 * words, generator=g)[:n]] = True
    bits[7] = True
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    full = (bits.view(8, words, 32).to(torch.int64) * weights).sum(-1)
    full = torch.where(full >= 2**31, full - 2**32, full).to(torch.int32)
    logits = torch.randn(9, vocab, generator=g)
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 4, 6], [3, 5, 7], [6]):
        want = logits.clone()
        for r in rows:
            for t in range(vocab):
                if t >= 32 * words or not bits[r, t]:
                    want[r, t] = float("-inf")
        plan = MaskPlan(full, rows)
        assert sorted(plan.sparse_rows + plan.dense_rows) == sorted(rows)
        assert {0, 1, 2, 4, 6} & set(rows) == set(plan.sparse_rows)
        for r in plan.sparse_rows:
            assert plan.sparse_ids[plan.sparse_row == r].tolist() == torch.nonzero(bits[r]).flatten().tolist()
        got = logits.clone()
        apply_token_bitmask(got, full, rows, plan)
        assert torch.equal(got, want), rows


def _packed(bits: torch.Tensor) -> torch.Tensor:
    """``[R, 32 W]`` bool -> the ``[R, W]`` int32 bitmask (bit ``t % 32`` of word ``t // 32``)."""
    rows, width = bits.shape
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    full = (bits.view(rows, width // 32, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(full >= 2**31, full - 2**32, full).to(torch.int32)


def _sched(i, **kw):
    from tokenmill.core.sched_output import ScheduledRequest

    return ScheduledRequest(req_id=f"r{i}", token_ids=[0], num_computed_tokens=0, block_ids=[0], sample=True,
                            sampling_params=SamplingParams(**kw), prompt_token_ids=[5, 6], output_token_ids=[7, 9])


@pytest.mark.parametrize("vocab", [200, 170])       # exact width; padding inside the last word
def test_deferred_sparse_rows_sample_the_masked_tokens(vocab):
    """Greedy rows whose sparse mask is left unwritten (``defer_sparse``) get the token the written mask gives:
    ties (the lowest allowed id), penalties and logit bias, a NaN or only ``-inf`` among a row's allowed
    logits (the sampler writes the mask and takes the full path), rows that are not deferred between them,
    and a sampled or logprobs row in the batch (the mask is written first)."""
    from tokenmill.model.sampler import Sampler

    g = torch.Generator().manual_seed(3)
    width = 32 * ((vocab + 31) // 32)
    bits = torch.rand(9, width, generator=g) < 0.6                                  # dense rows
    for r, n in ((0, 3), (1, 1), (3, 5), (4, 4), (6, 2), (7, 6)):                    # sparse rows
        bits[r] = False
        bits[r, torch.randperm(vocab, generator=g)[:n]] = True
    full = _packed(bits)
    rows = list(range(9))
    base = torch.randn(9, vocab, generator=g) * 3
    a0 = torch.nonzero(bits[0]).flatten()
    base[0, a0] = 5.0                                    # a tie: the lowest allowed id wins
    base[0, (a0.max() + 1) % vocab] = 9.0               # above the tie, refused
    a4 = torch.nonzero(bits[4]).flatten()
    cases = {"plain": base}
    nan = base.clone()
    nan[3, torch.nonzero(bits[3]).flatten()[1]] = float("nan")
    cases["nan allowed"] = nan
    ninf = base.clone()
    ninf[6, torch.nonzero(bits[6]).flatten()] = float("-inf")
    cases["all allowed -inf"] = ninf
    refused_nan = base.clone()
    refused_nan[4, int(torch.nonzero(~bits[4, :vocab]).flatten()[0])] = float("nan")
    cases["nan refused"] = refused_nan
    params = {"greedy": [dict(temperature=0)] * 9,
              "penalties and bias": [dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                                          logit_bias={int(a4[0]): 2.5, 7: -1.0})] * 9,
              "one sampled row": [dict(temperature=0)] * 8 + [dict(temperature=0.8, seed=4)],
              "one logprobs row": [dict(temperature=0, logprobs=2)] + [dict(temperature=0)] * 8}
    sampler = Sampler(seed=0)
    deferred_any = False
    for name, logits in cases.items():
        for pname, kws in params.items():
            reqs = [_sched(i, **kw) for i, kw in enumerate(kws)]
            masked = logits.clone()
            apply_token_bitmask(masked, full, rows)
            want = sampler(masked, reqs)
            got_logits = logits.clone()
            deferred = apply_token_bitmask(got_logits, full, rows, MaskPlan(full, rows), defer_sparse=True)
            assert isinstance(deferred, SparseRowsMask) and deferred.rows == [0, 1, 3, 4, 6, 7]
            dense = [2, 5, 8]
            assert torch.equal(got_logits[dense], masked[dense])            # dense rows written
            assert torch.equal(got_logits[deferred.rows], logits[deferred.rows]) or name.startswith("nan")
            got = sampler(got_logits, reqs, deferred=deferred)
            assert got[0] == want[0], (name, pname)
            assert got[1] == want[1], (name, pname)                        # logprobs of the masked rows
            if pname == "greedy" and name == "plain":
                assert got[0][0] == int(a0.min())
                deferred_any = True
    assert deferred_any
    # a row allowing nothing is never deferred (the written mask makes the sampler's full path decide)
    bits[1] = False
    deferred = apply_token_bitmask(base.clone(), _packed(bits), rows, defer_sparse=True)
    assert deferred is None


def test_sparse_rows_mask_argmax_and_write():
    """``SparseRowsMask.argmax`` is the argmax of the masked row (first maximum); ``write`` is the mask."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 7.0], [2.0, -1.0, 2.0, 0.5, 9.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    row = np.array([0, 0, 0, 2, 2], dtype=np.int64)
    ids = np.array([1, 2, 3, 2, 4], dtype=np.int64)
    m = SparseRowsMask([0, 2], row, ids)
    got, best = m.argmax(logits)
    assert got.tolist() == [1, 2] and best.tolist() == [3.0, 1.0]
    w = logits.clone()
    m.write(w)
    ninf = float("-inf")
    assert torch.equal(w, torch.tensor([[ninf, 3.0, 1.0, 3.0, ninf], [2.0, -1.0, 2.0, 0.5, 9.0],
                                        [ninf, ninf, 1.0, ninf, 1.0]]))
    assert w.argmax(dim=-1)[[0, 2]].tolist() == got.tolist()


def test_batched_fill_equals_one_by_one(backend, tokenizer):
    """xgrammar's batched fill gives every row what the request's own fill gives."""
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prefixes = ['{"name": "B', '{"name": "Bob", "age": ', "", '{"name": "Al', '{"name": "x", "age": 7']
    matchers = [walk(backend, tokenizer, params, p) for p in prefixes]
    one = backend.allocate_bitmask(7)
    for m, r in zip(matchers, [0, 2, 3, 5, 6]):
        m.fill_bitmask(one, r)
    batched = backend.allocate_bitmask(7)
    backend.fill_bitmasks(matchers, batched, [0, 2, 3, 5, 6])
    assert torch.equal(one, batched) and torch.all(batched[1] == -1)


class _Req:
    def __init__(self, rid, params, outputs=()):
        self.request_id = rid
        self.sampling_params = SamplingParams(max_tokens=64, structured_outputs=params)
        self.output_token_ids = list(outputs)


class _SR:
    def __init__(self, rid, spec=(), sample=True):
        self.req_id, self.spec_token_ids, self.sample = rid, list(spec), sample


def _ready(mgr, req, timeout=60.0):
    t0 = time.monotonic()
    while (state := mgr.poll(req)) is None:
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)
    return state


def test_manager_cache_bitmask_rows_drafts_and_rebuild(tokenizer):
    mgr = StructuredOutputManager(StructuredOutputsConfig(), 49152, [EOS], lambda: tokenizer)
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    a, b = _Req("a", params), _Req("b", StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    mgr.add_request(a)
    mgr.add_request(b)
    assert _ready(mgr, a) == "ready" and _ready(mgr, b) == "ready"
    assert mgr.stats.cache_queries == 2 and mgr.stats.cache_hits == 1 and mgr.stats.compile_count == 1
    assert mgr.stats.requests_by_kind == {"json": 2}
    drafts, forced = mgr.drafts(a, [], 8)
    assert forced and drafts
    # rows: an unconstrained request (2 rows), a non-sampling chunk (none), a with its drafts, b with none
    so = type("SO", (), {"scheduled": [_SR("x", [5]), _SR("y", sample=False), _SR("a", drafts), _SR("b")]})()
    gb = mgr.grammar_bitmask(so)
    assert gb.rows == list(range(2, 2 + len(drafts) + 1)) + [2 + len(drafts) + 1]
    # the fill waits for the runner's start (the forward), not the schedule: nothing filled yet
    time.sleep(0.05)
    assert mgr.stats.mask_steps == 0
    gb.start()
    gb.start()                                              # idempotent
    bm = gb.result()
    assert mgr.stats.mask_steps == 1
    assert bm.shape[0] == 2 + len(drafts) + 2 and torch.all(bm[:2] == -1)    # x's rows allow everything
    # row j of a allows draft j (the state after drafts[:j]); b's row equals a's first row (same state)
    for j, t in enumerate(drafts):
        assert t in allowed(bm, 2 + j)
    assert torch.equal(bm[2], bm[2 + len(drafts) + 1])
    assert mgr.drafts(a, [], 8) == (drafts, True)          # the fill rolled the drafts back
    # the step emits the drafts: accepted into the matcher; a proposer's draft the grammar refuses is cut
    a.output_token_ids += drafts
    assert not mgr.accept(a, drafts)
    name = tokenizer.encode('Bob", "age":', add_special_tokens=False)   # compact: ", " and ": "
    bad = tokenizer.encode("}}}", add_special_tokens=False)
    assert mgr.drafts(a, name + bad, 0) == (name, False)
    # out of step with the request's tokens (e.g. tokens appended elsewhere): rebuilt from them
    a.output_token_ids += name
    assert not mgr.accept(a, name[-1:])
    assert mgr._states["a"].num_accepted == len(a.output_token_ids)
    digits = tokenizer.encode(" 7}", add_special_tokens=False)
    a.output_token_ids += digits + [EOS]
    assert mgr.accept(a, digits + [EOS])                   # complete object, then EOS: terminated
    mgr.free("a")
    assert not mgr.has("a")
    mgr.shutdown()


def test_manager_compile_failure_and_timeout(tokenizer):
    mgr = StructuredOutputManager(StructuredOutputsConfig(compile_timeout_s=0.05), 49152, [EOS], tokenizer)
    bad = _Req("bad", StructuredOutputsParams(regex="(("))
    mgr.add_request(bad)
    err = _ready(mgr, bad)
    assert err.startswith("structured_outputs.regex: invalid regex") and mgr.stats.compile_failures == 1
    slow = StructuredOutputManager(StructuredOutputsConfig(compile_timeout_s=0.05), 49152, [EOS], tokenizer,
                                   backend_factory=lambda *a: _SlowBackend(XgrammarBackend(*a)))
    r = _Req("slow", StructuredOutputsParams(regex="x+"))
    slow.add_request(r)
    assert "took longer than 0.05 s" in _ready(slow, r) and slow.stats.compile_timeouts == 1
    slow.shutdown()
    mgr.shutdown()


class _SlowBackend:
    def __init__(self, inner):
        self.inner, self.name = inner, "slow"

    def compile(self, params):
        time.sleep(0.5)
        return self.inner.compile(params)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_bitmask_crosses_to_a_worker_process_filled(tokenizer):
    """Tensor/pipeline parallel: the step description is pickled; the bitmask travels filled."""
    import pickle

    mgr = StructuredOutputManager(StructuredOutputsConfig(), 49152, [EOS], tokenizer)
    r = _Req("r", StructuredOutputsParams(choice=["yes", "no"]))
    mgr.add_request(r)
    assert _ready(mgr, r) == "ready"
    so = type("SO", (), {"scheduled": [_SR("u"), _SR("r")]})()
    gb = pickle.loads(pickle.dumps(mgr.grammar_bitmask(so)))
    logits = torch.zeros(2, 49152)
    gb.apply(logits)
    ok = {t for t in range(49152) if logits[1, t] == 0}
    assert torch.all(logits[0] == 0)            # the unconstrained request's row is untouched
    assert ok and all(any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no")) for t in ok)
    mgr.shutdown()


def test_forced_drafts_learn_the_models_split(tokenizer):
    """Once the model wrote a forced string with its own split, the next request drafts that split."""
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    pieces = ["{", '"', "na", "me", '"', ":", ' "']         # '{"name": "' as the model might write it
    split = [tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(ids) == 1 for ids in split)
    split = [ids[0] for ids in split]
    canonical = tokenizer.encode('{"name": "', add_special_tokens=False)
    assert split != canonical
    for learn in (True, False):
        mgr = StructuredOutputManager(StructuredOutputsConfig(learn_forced_splits=learn), 49152, [EOS], tokenizer)
        a, b, c = (_Req(r, params) for r in "abc")
        for r in (a, b, c):
            mgr.add_request(r)
            assert _ready(mgr, r) == "ready"
        assert mgr.drafts(a, [], 16) == (canonical, True)      # nothing learned yet: the tokenizer's split
        a.output_token_ids += split                            # the model wrote it its own way
        assert not mgr.accept(a, split)
        want = split if learn else canonical
        assert mgr.drafts(b, [], 16) == (want, True)
        assert mgr.drafts(c, [], 3) == (want[:3], True)        # capped at the draft length
        c.output_token_ids += split[:2]                        # part-way through: the rest of the split
        mgr.accept(c, split[:2])
        rest = split[2:] if learn else tokenizer.encode('name": "', add_special_tokens=False)
        assert mgr.drafts(c, [], 16) == (rest, True)
        mgr.shutdown()


@pytest.mark.parametrize("cap", [20, 0])
def test_json_whitespace_is_capped_per_place(tokenizer, cap):
    """``max_whitespace`` bounds the optional whitespace in one place of a JSON constraint (a small greedy model
    otherwise writes newlines until max_tokens); 0 leaves it unbounded."""
    b = XgrammarBackend(tokenizer, 49152, [EOS], StructuredOutputsConfig(max_whitespace=cap))
    params = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    nl = tokenizer.encode("\n", add_special_tokens=False)
    m = b.new_matcher(b.compile(params))
    assert m.accept_tokens(tokenizer.encode("[", add_special_tokens=False)) == 1
    taken = sum(m.accept_tokens(nl) for _ in range(30))
    assert taken == (20 if cap else 30)
    with pytest.raises(ValueError, match="max_whitespace"):
        StructuredOutputsConfig(max_whitespace=-1)
