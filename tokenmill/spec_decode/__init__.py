"""Speculative decoding: proposers (n-gram prompt lookup, draft model), lossless verification, metrics.

Speculative tokens are just extra tokens to verify (docs/architecture.md): the scheduler
appends a request's draft tokens to its step, the target computes them in the
same flattened batch, :mod:`tokenmill.spec_decode.rejection_sampler` keeps the
accepted prefix plus one target token, and ``num_computed_tokens`` rolls back
over the rejected positions. Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", arXiv 2211.17192.

Modules: ``ngram`` (numpy), ``draft_model`` and ``rejection_sampler`` (torch),
``metrics`` (pure Python; the scheduler imports only this one).
"""
