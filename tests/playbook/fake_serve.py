"""``python -m tests.playbook.fake_serve [tokenmill serve flags]``: a real tokenmill HTTP server and engine core
whose executor is model-free, with a step time that grows with the step's tokens (4 ms + 0.25 ms per token), so
the scheduler's knobs (max_num_seqs, max_num_batched_tokens) change latency and goodput as on a real model.
Used by the ``tokenmill tune`` end-to-end test as ``--serve-command``."""

from __future__ import annotations

import sys
import time


def make_timed_fake_executor(config):
    from tests.server.fakes import make_fake_executor

    ex = make_fake_executor(config)
    inner = ex.execute_model
    ex.step_time = 0.0

    def execute_model(so):
        time.sleep(0.004 + 0.00025 * so.total_num_scheduled_tokens)
        return inner(so)

    ex.execute_model = execute_model
    return ex


def main(argv: list[str]) -> int:
    import uvicorn

    from tests.server.fakes import CharTokenizer
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.app import build_app
    from tokenmill.server.launch import create_server_state
    from tokenmill.server.cli_args import build_parser, config_from_args

    args = build_parser().parse_args(argv)
    config = config_from_args(args).replace(served_model_name="fake", max_model_len=1024,
                                             num_kv_blocks=args.num_kv_blocks or 128, log_stats_interval=0.0)
    tok = CharTokenizer()
    engine = AsyncEngine(config, tok, executor_factory=make_timed_fake_executor, start_timeout=60)
    engine.start()
    try:
        app = build_app(create_server_state(config, engine, tok, "/models/fake"))
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
