"""Tool-call parsers (``--tool-call-parser NAME``, vLLM's names), one module per output format.

``hermes`` (``<tool_call>{json}</tool_call>``), ``llama3_json`` (``{"name", "parameters"}``, also
``llama4_json``), ``mistral`` (``[TOOL_CALLS]``) and ``pythonic`` (``[f(a=1)]``) parse a model's free
text for ``tool_choice: "auto"``; :mod:`~tokenmill.server.tool_parsers.constrained` reads the output
that ``"required"`` and named tool choices constrain decoding to. The interface, the registry and the
streaming differ are in :mod:`~tokenmill.server.tool_parsers.base`.
"""

from tokenmill.server.tool_parsers import hermes, llama3_json, mistral, pythonic  # noqa: F401 - registration
from tokenmill.server.tool_parsers.base import (TOOL_PARSERS, ParseResult, PartialCall, ToolCallStreamer, ToolParser,
                                                get_tool_parser, parse_final, register_tool_parser)
from tokenmill.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser

__all__ = ["TOOL_PARSERS", "NamedToolParser", "ParseResult", "PartialCall", "RequiredToolParser",
           "ToolCallStreamer", "ToolParser", "get_tool_parser", "parse_final", "register_tool_parser"]
