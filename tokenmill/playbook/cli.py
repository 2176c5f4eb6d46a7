"""Sub-commands of the playbook: ``tokenmill plan``, ``tune``, ``run-batch`` and ``top``.

Wiring (from :mod:`tokenmill.cli`)::

    from tokenmill.playbook.cli import add_playbook_subparsers
    add_playbook_subparsers(subparsers)
"""

from __future__ import annotations

from typing import Any


def add_playbook_subparsers(sub: Any) -> None:
    """Add the playbook's sub-commands to an argparse subparsers object (each sets ``func``)."""
    from tokenmill.playbook import plan

    p = sub.add_parser("plan", help="Weight and KV-cache capacity of a model before loading it.",
                       description="Plan weights, KV bytes per token, pool size and the largest max_num_seqs "
                                   "without preemption, from a GGUF file, a HF folder or a bare config.json.")
    plan.add_plan_args(p)
    p.set_defaults(func=plan.run_plan)

    from tokenmill.playbook import top

    t = sub.add_parser("top", help="Live terminal view of a running server's /metrics.",
                       description="Requests, queue, KV usage, token rates, preemptions, prefix hits and "
                                   "p50/p99 latencies of a running tokenmill server, redrawn every --interval.")
    top.add_top_args(t)
    t.set_defaults(func=top.run_top)

    from tokenmill.playbook import run_batch

    b = sub.add_parser("run-batch", help="Run an OpenAI batch file (JSON lines) through a local engine.",
                       description="Read requests in the OpenAI batch format (/v1/completions, "
                                   "/v1/chat/completions), run them through a local engine with continuous "
                                   "batching and write one result line per request, in input order.")
    run_batch.add_run_batch_args(b)
    b.set_defaults(func=run_batch.run_batch_cli)

    from tokenmill.playbook import tune

    u = sub.add_parser("tune", help="Pull the playbook's levers one run at a time, measured as goodput.",
                       description="Measure run-to-run noise, then try the playbook's levers in order, one change "
                                   "per run on fresh servers, keeping a change only when goodput rises beyond the "
                                   "noise; writes a Markdown/JSON/PNG report and the final serve command.")
    tune.add_tune_args(u)
    u.set_defaults(func=tune.run_tune_cli)
