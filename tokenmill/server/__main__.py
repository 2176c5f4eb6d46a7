"""``python -m tokenmill.server [MODEL] [flags]``: run the OpenAI-compatible server.

Same flags as ``tokenmill serve`` (see ``--help``).
"""

from __future__ import annotations

import sys
from tokenmill.server.launch import run_server
from tokenmill.server.cli_args import build_parser, config_from_args


def main(argv: list[str] | None = None) -> int:
    """Parse the serve flags and run the server until SIGINT/SIGTERM; returns the exit status."""

    parser = build_parser("python -m tokenmill.server")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return run_server(config)   # non-zero when the engine core died


if __name__ == "__main__":
    sys.exit(main())
