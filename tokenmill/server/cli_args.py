"""``tokenmill serve`` flags, generated from the :mod:`tokenmill.config` dataclasses.

Every field of the model, cache, scheduler and server sections becomes a flag
with vLLM's spelling (``max_num_seqs`` → ``--max-num-seqs``); booleans get a
``--x/--no-x`` pair (:class:`argparse.BooleanOptionalAction`); the help text is
the field's ``metadata["help"]`` plus its default. The model may also be given
positionally (``tokenmill serve MODEL``), as with ``vllm serve``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig
from tokenmill.server.slo_predictor import SLO

SECTIONS: list[tuple[str, type]] = [
    ("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig), ("server", ServerConfig),
    ("parallel", ParallelConfig),
]
# Fields with a closed set of values (unless the field's metadata gives "choices").
_CHOICES: dict[str, list[str]] = {
    "scheduling_policy": ["fcfs", "priority"],
    "dtype": ["auto", "float32", "bfloat16", "float16"],
}
_METAVARS: dict[str, str] = {"kv_cache_memory": "SIZE", "model": "MODEL", "tokenizer": "PATH",
                             "log_stats_interval": "SECONDS", "host": "HOST", "port": "PORT",
                             "api_key": "KEY", "served_model_name": "NAME", "device": "DEVICE"}
# Dest of the positional MODEL (merged with --model).
_POSITIONAL_DEST = "model_tag"


def _base_type(annotation: Any) -> type:
    """``int | None`` → int, ``bool`` → bool, ..."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_serve_args(parser: argparse.ArgumentParser, include_server: bool = True) -> argparse.ArgumentParser:
    """Add the ``serve`` flags (one per config field, vLLM names) to ``parser``; returns it.

    Defaults are the dataclass defaults, so ``config_from_args(parser.parse_args([]))``
    equals ``EngineConfig()``. With ``include_server=False`` only the engine
    sections (model, cache, scheduler) are added, without the fields marked
    ``server_only`` (admission control), for ``tokenmill generate``.
    """
    parser.add_argument(_POSITIONAL_DEST, nargs="?", default=None, metavar="MODEL",
                        help="Model to serve: a GGUF file or a Hugging Face checkpoint folder (same as --model). "
                             "Default: the packaged SmolLM2-135M-Instruct.")
    for section, cls in SECTIONS:
        if section == "server" and not include_server:
            continue
        group = parser.add_argument_group(f"{section} options", (cls.__doc__ or "").strip().splitlines()[0])
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("server_only") and not include_server:
                continue            # e.g. admission control: only the HTTP server refuses requests
            flag = "--" + f.name.replace("_", "-")
            typ = _base_type(hints[f.name])
            text = f.metadata.get("help", "")
            if f.default is not None and f.default is not dataclasses.MISSING:
                text += f" [default: {f.default}]"
            text = text.replace("%", "%%")
            kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": text}
            if typ is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            choices = f.metadata.get("choices") or _CHOICES.get(f.name)
            if choices:
                kw["choices"] = choices
            if not choices:
                kw["metavar"] = (f.metadata.get("metavar") or _METAVARS.get(f.name)
                                 or ("N" if typ is int else f.name.upper()))
            if f.metadata.get("nargs"):
                kw["nargs"] = f.metadata["nargs"]      # several words, joined into one string value
            group.add_argument(flag, *f.metadata.get("aliases", ()), type=typ if typ in (int, float, str) else str,
                               **kw)
    spec = parser.add_argument_group("speculative decoding options",
                                     "Draft tokens verified by the target in one pass (lossless).")
    spec.add_argument("--speculative-config", dest="speculative_config", default=None, metavar="JSON",
                      help="vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                           "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", "
                           "\"model\": PATH, \"num_speculative_tokens\": 4}; optional "
                           "\"num_speculative_tokens_per_batch_size\": [[1, 4, 4], [5, 16, 2], [17, 64, 0]] "
                           "(dynamic draft length by running requests). [default: off]")
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the :class:`EngineConfig` from parsed ``serve`` arguments.

    Raises:
        ValueError: a value the config rejects (e.g. ``--block-size 0``), or a
            model given both positionally and with ``--model`` (differently).
    """
    values: dict[str, Any] = {}
    for _, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name):
                value = getattr(args, f.name)
                values[f.name] = (f.metadata.get("join", " ").join(map(str, value)) if isinstance(value, list)
                                  else value)
    tag = getattr(args, _POSITIONAL_DEST, None)
    if tag is not None:
        if values.get("model") not in (None, tag):
            raise ValueError(f"model given twice: positional {tag!r} and --model {values['model']!r}")
        values["model"] = tag
    if values.get("slo"):
        SLO.parse(values["slo"])        # ValueError with the bad item
    if getattr(args, "speculative_config", None) is not None:
        values["speculative_config"] = args.speculative_config
    return EngineConfig.from_kwargs(**values)


def build_parser(prog: str = "tokenmill serve") -> argparse.ArgumentParser:
    """A stand-alone parser with the serve flags (used by ``python -m tokenmill.server``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a model behind an OpenAI-compatible HTTP API.",
    )
    return add_serve_args(parser)
