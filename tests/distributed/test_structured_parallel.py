"""Structured outputs under tensor and pipeline parallelism (mp workers, tiny random Llama, float32).

The engine core owns every matcher and fills the step's bitmask; the bitmask travels with the step
description to the workers, where the rank that samples applies it (TP: every rank samples the same
rows; PP: the last stage). Grammar-forced drafts go through the same verify path as speculative
decoding. Greedy constrained tokens (with forced drafts) must equal the single process's without them,
the unconstrained request in the same batch included, and every constrained output must match.
"""

from __future__ import annotations

import re

import pytest

from tests.distributed.conftest import save_tiny_llama
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=128, max_num_seqs=8)
# free choices (decided by the logits) between forced runs of several words (grammar-forced drafts)
GRAMMAR = 'root ::= ("w021" | "w022" | "w023") "w040w041w042w043" ("w028" | "w029")+ "w050w051w052w053"'
GRAMMAR_RE = r"(w021|w022|w023)w040w041w042w043(w028|w029)+w050w051w052w053"
REGEX = r"(w01[1-9]|w03[0-5]){2,6}w099"
CHOICE = ["w070w071w072w073w074", "w080w081", "w090w091w092"]
PROMPTS = [" ".join(f"w{3 + (i * 11 + j) % 90:03d}" for j in range(n)) for i, n in enumerate((9, 17, 5, 12, 7))]


def _params() -> list[SamplingParams]:
    so = [StructuredOutputsParams(grammar=GRAMMAR), StructuredOutputsParams(regex=REGEX),
          StructuredOutputsParams(choice=CHOICE), StructuredOutputsParams(grammar=GRAMMAR), None]
    # max_tokens 24: the "+" runs may be cut (finish "length"); the same cut must happen everywhere
    return [SamplingParams(temperature=0, max_tokens=24, structured_outputs=s, ignore_eos=s is None) for s in so]


def _run(llm: LLM) -> list:
    """The batch twice: the second round drafts the forced runs with the words the first wrote them with (the
    tokenizer cannot split "w040w041": its words are whitespace-separated)."""
    return [o.outputs[0] for _ in range(2) for o in llm.generate(PROMPTS, _params())]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_structured"), word_width=3)


def _words(llm: LLM, ids: list[int]) -> str:
    tok = llm.get_tokenizer()
    return "".join(tok.convert_ids_to_tokens(t) for t in ids if t != tok.eos_token_id)


@pytest.fixture(scope="module")
def reference(tiny):
    with LLM(tiny, **ENGINE, structured_outputs_config={"num_forced_draft_tokens": 0}) as llm:
        outs = _run(llm)
        words = [_words(llm, o.token_ids) for o in outs]
    for o, w, pattern in zip(outs, words, (GRAMMAR_RE, REGEX, "|".join(CHOICE), GRAMMAR_RE, None) * 2):
        if pattern is None:
            continue
        if o.finish_reason == "stop":
            assert re.fullmatch(pattern, w), w
        else:       # cut by max_tokens: a prefix of a match
            assert o.finish_reason == "length" and len(o.token_ids) == 24
    assert any(o.finish_reason == "stop" for o in outs[:4])
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_constrained_tokens_equal_one_process(tiny, reference, tp, pp):
    # forced drafts in batches of up to 8 (the default 4 would leave this batch of 5 without them)
    with LLM(tiny, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE,
             structured_outputs_config={"forced_draft_max_batch": 8}) as llm:
        assert len(llm.engine_core.executor.pids) == tp * pp
        outs = _run(llm)
        stats = llm.engine_core.structured_output.stats
        inv = llm.engine_core.check_invariants()
    assert [(o.token_ids, o.finish_reason) for o in outs] == reference
    # the forced runs went out as drafts and the workers' verify steps accepted some of them
    assert stats.forced_draft_tokens > 0 and stats.forced_accepted_tokens > 0, stats
    assert stats.requests_by_kind == {"grammar": 4, "regex": 2, "choice": 2}
    assert inv["problems"] == []
