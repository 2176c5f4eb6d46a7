"""``tokenmill router`` flags (SGLang's and Dynamo's names for their knobs)."""

from __future__ import annotations

import argparse
import sys

from tokenmill.config import TOOL_CALL_PARSERS
from tokenmill.router.backends import BackendSpec, load_backend_file
from tokenmill.router.policies import POLICIES


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``router`` sub-command to the ``tokenmill`` parser."""
    p = sub.add_parser("router", help="Route OpenAI API requests over several backends (cache-aware).",
                       description="A separate process speaking the OpenAI API in front of several backends "
                                   "(tokenmill serve, vLLM, SGLang), with cache-aware routing policies.")
    p.add_argument("--backend", action="append", default=[], metavar="URL[,kv_events=ADDR][,replay=ADDR]",
                   help="A backend (repeat the flag). kv_events / replay: the backend's --kv-events-config "
                        "endpoint and replay_endpoint (for --policy kv_aware).")
    p.add_argument("--backend-file", default=None, metavar="PATH",
                   help="File of backends: one spec per line (# comments) or a JSON list of "
                        "{url, kv_events, replay} objects.")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind [default: 127.0.0.1].")
    p.add_argument("--port", type=int, default=8080, help="TCP port to bind [default: 8080].")
    p.add_argument("--policy", choices=POLICIES, default="round_robin", help="Routing policy [default: round_robin].")
    p.add_argument("--load-source", choices=["inflight", "metrics"], default="inflight",
                   help="least_load: requests in flight from this router, or running + waiting from the "
                        "backends' /metrics (read at each health check) [default: inflight].")
    g = p.add_argument_group("prefix_aware (SGLang's cache-aware rule)")
    g.add_argument("--cache-threshold", type=float, default=0.3,
                   help="Prefix match ratio (matched / prompt characters) above which the best-matching "
                        "backend wins [default: 0.3].")
    g.add_argument("--balance-abs-threshold", type=int, default=64,
                   help="Load is imbalanced when max - min in-flight requests exceeds this (and the relative "
                        "rule holds); then the least loaded backend wins [default: 64].")
    g.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and max > min x this ratio [default: 1.5].")
    g.add_argument("--max-tree-size", type=int, default=2**26,
                   help="Characters kept per backend prefix tree; least recently used leaves are evicted "
                        "beyond [default: 2^26].")
    g.add_argument("--prefix-placement", action=argparse.BooleanOptionalAction, default=False,
                   help="prefix_aware: keep prefix groups resident as kv_aware's --kv-placement does, from the "
                        "prompts' text (chunks of about one KV block) and the backends' reported pools (no KV "
                        "events: a group's home is never found evicted). Off by default: it did not raise "
                        "prefix_aware's cached tokens on benchmarks/routing.py's family [default: off].")
    g = p.add_argument_group("kv_aware (Dynamo's KV router cost)")
    g.add_argument("--kv-overlap-score-weight", type=float, default=1.0,
                   help="Weight of prefill blocks in cost = weight x (prefill_blocks + eviction_weight x "
                        "evicted_blocks + recompute_weight x recomputed_blocks) + decode_blocks (Dynamo's flag) "
                        "[default: 1].")
    g.add_argument("--kv-eviction-weight", type=float, default=1.0,
                   help="Weight, relative to a prefill block, of each reused cached block a placement would "
                        "evict from the backend's pool (tokenmill's term; 0 here and in --kv-recompute-weight "
                        "gives Dynamo's cost) [default: 1].")
    g.add_argument("--kv-recompute-weight", type=float, default=1.0,
                   help="Weight, relative to a prefill block, of each prompt block the backend would prefill "
                        "although another backend holds it or is computing it: a prefix group leaves its "
                        "replica only when the cost gap exceeds the prefix it recomputes (tokenmill's term; "
                        "0: Dynamo's cost) [default: 1].")
    g.add_argument("--kv-tier-weight", type=float, default=None,
                   help="Cost, relative to a prefill block, of a prompt block the backend would load from its KV "
                        "offloading tier (its KV events with medium DISK or CPU) instead of computing it; in "
                        "[0, 1] (tokenmill's term; 1: a tier hit counts for nothing) [default: 0.15, the TTFT "
                        "growth per block loaded over that per block computed, measured on a CPU; see "
                        "docs/guide/kv_offload.md].")
    g.add_argument("--kv-prefill-wait", action=argparse.BooleanOptionalAction, default=True,
                   help="Hold a request at the router while the backend it would go to holds part of its prefix "
                        "only as blocks another request is still computing there (in flight, no BlockStored "
                        "event yet): the engine shares computed blocks only, so sent at once it would prefill "
                        "them a second time. It goes when the events confirm them, that request ends, or "
                        "--router-queue-timeout passes (tokenmill's; --no-kv-prefill-wait: never hold) "
                        "[default: on].")
    g.add_argument("--active-decode-blocks-threshold", type=float, default=1.0, metavar="FRACTION",
                   help="A backend whose in-flight requests plus this one would hold more than this fraction of "
                        "its KV pool (size from its /metrics cache_config_info, else learnt from its events once it evicts) is busy: requests go to the "
                        "others, and wait at the router while every backend is busy, up to "
                        "--router-queue-timeout (Dynamo's flag name; Dynamo rejects instead of waiting). At 1 a "
                        "request waits only when it cannot fit next to the KV in flight, where the engine would "
                        "queue it too; 0: off [default: 1].")
    g.add_argument("--kv-placement", action=argparse.BooleanOptionalAction, default=True,
                   help="Keep prefix groups resident: knowing each backend's KV pool (its /metrics "
                        "cache_config_info) and the prefix groups' sizes (from the prompts' block hashes), "
                        "send a group to the replicas holding it, place a new group where it fits beside the "
                        "groups already there, and partition the groups over the replicas when they do not "
                        "all fit in one pool (tokenmill/router/placement.py; --no-kv-placement: the cost "
                        "alone) [default: on].")
    g.add_argument("--kv-move-margin", type=float, default=4.0, metavar="X",
                   help="With --kv-placement: a request of a placed group leaves (or copies the group off) its "
                        "replicas only for one whose cost is lower by more than X times the group's prefix "
                        "blocks, on top of the recompute term (tuned on benchmarks/routing.py's family: 4 was "
                        "best of 0-8 on its tuning half) [default: 4].")
    g.add_argument("--router-queue-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="Longest a request waits at the router (--kv-prefill-wait, --active-decode-blocks-"
                        "threshold) before it is routed anyway; 0: never wait [default: 30].")
    g.add_argument("--router-temperature", type=float, default=0.0,
                   help="Softmax temperature over normalised costs (0: always the cheapest) [default: 0].")
    g.add_argument("--block-size", type=int, default=16,
                   help="Backends' KV block size in tokens until their events say otherwise [default: 16].")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Tokenizer of the served model (GGUF or HF folder), to hash prompts as the backends do "
                        "[default: the packaged SmolLM2-135M-Instruct].")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="The backends' --tool-call-parser: a chat template without tool support shows the tools "
                        "and earlier calls in its syntax, so the router must render tools the same way to hash "
                        "the blocks the backends cache [default: none, as the backends' default].")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="The backends' --exclude-tools-when-tool-choice-none (tool_choice 'none' leaves the tools "
                        "out of the prompt).")
    g.add_argument("--kv-events-topic", default="", help="Topic to subscribe to [default: all].")
    g = p.add_argument_group("health and retries")
    g.add_argument("--health-check-interval", type=float, default=1.0,
                   help="Seconds between health checks (/health and /v1/models) [default: 1].")
    g.add_argument("--health-check-timeout", type=float, default=2.0, help="Seconds per check [default: 2].")
    g.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20, metavar="BYTES",
                   help="Largest accepted request body; larger ones get HTTP 413 before they are read "
                        "(0: no limit) [default: 16 MiB, as tokenmill serve].")
    g.add_argument("--health-failure-threshold", type=int, default=3, metavar="N",
                   help="Health checks in a row that time out or fail on the network before a backend leaves the "
                        "rotation (SGLang's router flag); a /health error status or a refused connection takes "
                        "it out at once [default: 3].")
    g.add_argument("--dead-backend-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="A backend out of the rotation this long (failing health checks, e.g. a hung machine) "
                        "has its requests in flight failed: 502 before the answer started, an error event "
                        "and the end of the stream after [default: 30].")
    g.add_argument("--max-retries", type=int, default=2,
                   help="Other backends tried when one cannot be reached (connection refused or timed out) "
                        "[default: 2].")
    g.add_argument("--backend-api-key", default=None, metavar="KEY",
                   help="Bearer key for the health checks' GET /v1/models on backends started with --api-key "
                        "(clients' own Authorization headers are forwarded unchanged).")
    g.add_argument("--seed", type=int, default=None, help="Seed of the softmax draw.")
    g.add_argument("--decision-log", default=None, metavar="PATH",
                   help="kv_aware: append one JSON line per routed request to PATH (every candidate's overlap "
                        "from events and from in-flight requests, each cost term, the chosen and cheapest "
                        "backends, the TTFT the router saw, the backend's cached_tokens, the KV event lag), "
                        "to see why it routed where it did.")
    g = p.add_argument_group("prefill-decode disaggregation (tokenmill/router/pd.py)")
    g.add_argument("--pd-disaggregation", action="store_true",
                   help="Send each request to a --prefill server (max_tokens 1, kv_transfer_params "
                        "do_remote_decode) and then, with the KV it kept, to a --decode server whose response "
                        "is streamed back. The servers need --kv-transfer-config (kv_producer / kv_consumer).")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="A prefill server (repeat the flag); with --pd-disaggregation.")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="A decode server (repeat the flag); with --pd-disaggregation.")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace):
    """The :class:`RouterConfig` of parsed flags.

    Raises:
        ValueError: no backend, or a bad backend spec.
    """
    from tokenmill.router.router import RouterConfig

    specs = [BackendSpec.parse(s) for s in args.backend]
    if args.backend_file:
        specs += load_backend_file(args.backend_file)
    prefill = [BackendSpec.parse(s) for s in args.prefill]
    decode = [BackendSpec.parse(s) for s in args.decode]
    if args.pd_disaggregation:
        if not prefill or not decode:
            raise ValueError("--pd-disaggregation needs at least one --prefill URL and one --decode URL")
        if specs:
            raise ValueError("--pd-disaggregation takes --prefill and --decode servers, not --backend")
    elif prefill or decode:
        raise ValueError("--prefill / --decode need --pd-disaggregation")
    elif not specs:
        raise ValueError("give at least one --backend URL or a --backend-file")
    if args.decision_log:
        check_writable(args.decision_log, "--decision-log")
        if args.policy != "kv_aware":
            print(f"tokenmill router: warning: --decision-log records kv_aware decisions only; with --policy "
                  f"{args.policy} it stays empty", file=sys.stderr)
    return RouterConfig(
        backends=specs, policy=args.policy, host=args.host, port=args.port, cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold, balance_rel_threshold=args.balance_rel_threshold,
        max_tree_size=args.max_tree_size, kv_overlap_score_weight=args.kv_overlap_score_weight,
        kv_eviction_weight=args.kv_eviction_weight, kv_recompute_weight=args.kv_recompute_weight,
        kv_tier_weight=args.kv_tier_weight,
        router_temperature=args.router_temperature, block_size=args.block_size, tokenizer=args.tokenizer,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none, kv_events_topic=args.kv_events_topic, health_check_interval=args.health_check_interval,
        health_check_timeout=args.health_check_timeout, health_failure_threshold=args.health_failure_threshold,
        max_request_body_bytes=args.max_request_body_bytes,
        max_retries=args.max_retries, seed=args.seed,
        load_source=args.load_source, backend_api_key=args.backend_api_key,
        pd_disaggregation=args.pd_disaggregation, prefill=prefill, decode=decode, decision_log=args.decision_log,
        kv_prefill_wait=args.kv_prefill_wait, active_decode_blocks_threshold=args.active_decode_blocks_threshold,
        router_queue_timeout=args.router_queue_timeout, dead_backend_timeout=args.dead_backend_timeout,
        kv_placement=args.kv_placement, kv_move_margin=args.kv_move_margin, prefix_placement=args.prefix_placement)


def check_writable(path: str, flag: str) -> None:
    """Raise a clear ``ValueError`` unless ``path`` can be opened for appending (a file, not a folder).

    Raises:
        ValueError: the folder does not exist, the path is a folder, or it is not writable.
    """
    import os

    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path")
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    from tokenmill.router.app import run_router

    try:
        config = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"tokenmill router: error: {e}", file=sys.stderr)
        return 2
    try:
        run_router(config)
    except OSError as e:   # e.g. the --decision-log file vanished between the check and the open
        print(f"tokenmill router: error: {e}", file=sys.stderr)
        return 2
    return 0
