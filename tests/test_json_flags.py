"""Issue 28's rule for the structured flags: each is parsed once, where its config section is built, into a
frozen dataclass; the properties the engine reads return that object (no re-parsing on access)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenmill import config as cfg

# flag (a ModelConfig / CacheConfig / ParallelConfig field) -> (section, property, its parser in config.py, a value)
FLAGS = {
    "structured_outputs_config": (cfg.ModelConfig, "structured_outputs", ("StructuredOutputsConfig", "from_json"),
                                  json.dumps({"backend": "xgrammar", "max_whitespace": 4})),
    "lora_modules": (cfg.ModelConfig, "lora_module_list", (None, "parse_lora_modules"),
                     'a=/x/a\n{"name": "b", "path": "/x/b"}'),
    "kv_events_config": (cfg.CacheConfig, "kv_events", ("KVEventsConfig", "from_json"),
                         json.dumps({"enable_kv_cache_events": True, "buffer_steps": 5})),
    "kv_transfer_config": (cfg.CacheConfig, "kv_transfer", ("KVTransferConfig", "from_json"),
                           json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer"})),
    "eplb_config": (cfg.ParallelConfig, "eplb", ("EplbConfig", "from_json"), json.dumps({"window_size": 7})),
}


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_json_flag_parsed_once_into_frozen_data(flag, monkeypatch):
    section, prop, (owner, fn), value = FLAGS[flag]
    calls = []
    target = getattr(cfg, owner) if owner else cfg
    real = getattr(target, fn)

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(target, fn, counting)
    kwargs = {flag: value}
    if flag == "lora_modules":
        kwargs["enable_lora"] = True
    conf = section(**kwargs)
    assert len(calls) == 1, f"{flag} parsed {len(calls)} times while building {section.__name__}"
    first = getattr(conf, prop)
    for _ in range(3):
        assert getattr(conf, prop) is first
    assert len(calls) == 1, f"{section.__name__}.{prop} re-parses --{flag.replace('_', '-')} on access"
    if flag == "lora_modules":        # a tuple of frozen entries
        assert isinstance(first, tuple) and len(first) == 2
        parsed = first[0]
    else:
        parsed = first
    assert dataclasses.is_dataclass(parsed) and type(parsed).__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(parsed, dataclasses.fields(parsed)[0].name, None)


def test_every_json_metavar_flag_is_listed_here():
    """A new JSON-valued flag gets a parsed, frozen form (and a row in FLAGS above)."""
    json_flags = {f.name for section in (cfg.ModelConfig, cfg.CacheConfig, cfg.SchedulerConfig, cfg.ParallelConfig,
                                         cfg.ServerConfig)
                  for f in dataclasses.fields(section)
                  if f.metadata.get("metavar") == "JSON" or "JSON" in str(f.metadata.get("help", ""))[:120]}
    assert json_flags <= set(FLAGS), f"JSON-valued flags without a parsed form here: {sorted(json_flags - set(FLAGS))}"
