"""``tokenmill tune``: the playbook's lever search, one change per run, measured as goodput.

Given a model, a workload (a ``bench serve`` dataset spec or a JSONL of the
user's prompts) and an SLO (``--goodput ttft:MS tpot:MS`` with an attainment
target), ``tune``:

1. **measures run-to-run noise** first: the starting configuration is
   measured ``--noise-runs`` times, each on a fresh server; the noise is the
   relative spread ``(max − min) / mean`` of those goodputs. A change is kept
   only when its goodput exceeds the best so far by more than
   ``max(noise, --precision)`` (the goodput search itself cannot resolve rates
   closer than its bisection precision).
2. **pulls the levers in the playbook's order**, one change per run, each run
   on a fresh ``tokenmill serve`` process with the same seeded workload:
   ``max_num_seqs`` and KV memory until preemptions stop (candidates from
   :mod:`tokenmill.playbook.plan`), ``max_num_batched_tokens`` and
   ``long_prefill_token_threshold`` against whichever of TTFT / TPOT is
   closer to its limit, prefix caching, KV cache dtype, weight quantization,
   speculative decoding, replicas. A lever is pulled only when the engine has
   its flag (read from the ``tokenmill serve`` parser when ``tune`` runs);
   the others are reported as skipped, with the reason. A kept change
   becomes the new baseline and its lever may step again in the same
   direction (up to ``MAX_STEPS_PER_LEVER``).
3. **measures each run as goodput** with ``tokenmill bench goodput``'s
   machinery (:func:`tokenmill.bench.goodput_search.search_goodput`, DistServe
   arXiv 2401.09670 §2.2: the highest Poisson rate at which ``--attainment``
   of requests meet every SLO), plus the preemptions the server counted.
4. **writes a report**: ``tune_report.md``, ``tune_report.json`` and
   ``tune_report.png`` with every trial, its goodput and p99s, what was kept
   and why, and the final ``tokenmill serve`` command line.

``--budget-minutes`` bounds the wall time spent measuring (a trial is not
started when the mean trial time would overrun it). Every measurement is
saved in a state file as soon as it is done; rerunning the same command
replays the decisions from saved measurements and continues where it stopped.

The package, one job per module: :mod:`~tokenmill.playbook.tune.flags` (serve flags as data),
:mod:`~tokenmill.playbook.tune.settings` (the session's settings, the lever order),
:mod:`~tokenmill.playbook.tune.server` (a trial's server process), :mod:`~tokenmill.playbook.tune.measure`
(one trial's goodput), :mod:`~tokenmill.playbook.tune.planning` (capacity plans, the accuracy report),
:mod:`~tokenmill.playbook.tune.levers` (the eight levers), :mod:`~tokenmill.playbook.tune.state` (resume),
:mod:`~tokenmill.playbook.tune.search` (the search), :mod:`~tokenmill.playbook.tune.report` (the report),
:mod:`~tokenmill.playbook.tune.cli` (``tokenmill tune``). Every name is re-exported here.
"""

from __future__ import annotations

from tokenmill.playbook.tune.flags import (serve_options, flags_to_argv, merge_serve_args, normalize_flags,
                                           serve_defaults)
from tokenmill.playbook.tune.settings import LEVER_ORDER, TuneSettings
from tokenmill.playbook.tune.server import ServerProcess, free_port, scrape_preemptions
from tokenmill.playbook.tune.measure import (Measurement, warm_then_search, GoodputMeasurer)
from tokenmill.playbook.tune.planning import (load_accuracy_report, plan_capacity)
from tokenmill.playbook.tune.levers import (MAX_STEPS_PER_LEVER, Change, LeverContext, lever_max_num_seqs,
                                            lever_max_num_batched_tokens, lever_long_prefill_token_threshold,
                                            lever_prefix_caching, lever_kv_cache_dtype, lever_quantization,
                                            lever_speculative, lever_replicas, LEVERS)
from tokenmill.playbook.tune.state import (STATE_VERSION, Trial, StateFile)
from tokenmill.playbook.tune.search import (TuneResult, tune, LeverSearch)
from tokenmill.playbook.tune.report import (result_json, format_markdown, plot_trials, write_report)
from tokenmill.playbook.tune.cli import (add_tune_args, settings_from_args, run_tune_cli)  # noqa: F401

__all__ = [
    "serve_options", "flags_to_argv", "merge_serve_args", "normalize_flags", "serve_defaults", "LEVER_ORDER",
    "TuneSettings", "free_port", "scrape_preemptions", "ServerProcess", "Measurement", "warm_then_search",
    "GoodputMeasurer", "load_accuracy_report", "plan_capacity", "MAX_STEPS_PER_LEVER", "Change", "LeverContext",
    "lever_max_num_seqs", "lever_max_num_batched_tokens", "lever_long_prefill_token_threshold",
    "lever_prefix_caching", "lever_kv_cache_dtype", "lever_quantization", "lever_speculative", "lever_replicas",
    "LEVERS", "STATE_VERSION", "Trial", "StateFile", "TuneResult", "tune", "LeverSearch", "result_json",
    "format_markdown", "plot_trials", "write_report", "add_tune_args", "settings_from_args", "run_tune_cli",
]
