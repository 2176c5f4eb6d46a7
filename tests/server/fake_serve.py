"""``python -m tests.server.fake_serve [tokenmill serve flags]``: the real server (:func:`tokenmill.server.launch.serve`:
HTTP process, engine core process, ZMQ, crash handling, exit code) with a model-free executor from
:mod:`tests.server.fakes`; ``TOKENMILL_FAKE_EXECUTOR`` names its factory (default ``make_fake_executor``).
Used by the crash, fuzz and soak tests, which need a live server but no model."""

from __future__ import annotations

import sys

from tokenmill import envs


def main(argv: list[str]) -> int:
    import tests.server.fakes as fakes
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.cli_args import build_parser, config_from_args
    from tokenmill.server.launch import serve

    args = build_parser().parse_args(argv)
    config = config_from_args(args).replace(served_model_name="fake", max_model_len=args.max_model_len or 512,
                                             num_kv_blocks=args.num_kv_blocks or 256)
    tok = fakes.CharTokenizer()
    factory = getattr(fakes, envs.TOKENMILL_FAKE_EXECUTOR)
    engine = AsyncEngine(config, tok, executor_factory=factory, start_timeout=300)   # a loaded 2-core machine is slow to spawn
    engine.start()
    print(f"engine core pid {engine.info.pid}", flush=True)
    return serve(config, engine, tok, "/models/fake")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
