"""Process launch: start the engine core, load the tokenizer, serve HTTP with uvicorn until a signal.

Start-up order (docs/architecture.md, "Start-up"): the engine core process is spawned first, before
this process imports the HTTP stack (FastAPI, uvicorn, prometheus_client) and loads the tokenizer, so
the two processes' imports and loading overlap. That is why the server modules are imported inside
the functions below rather than at the top.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from tokenmill import envs
from tokenmill.config import GEMM_SHAPE_CACHE_CAPACITY, EngineConfig, bound_gemm_shape_caches  # noqa: F401

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.serving import ServerState

logger = logging.getLogger("tokenmill.server")

BIND_FAILED_EXIT_CODE = 3   # uvicorn's own start-up failure status, which this check replaces


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP listening socket (TCP, ``SO_REUSEADDR``; IPv6 when ``host`` contains ``:``), before
    anything slow happens, as vLLM's ``create_server_socket`` does: a port in use fails the start at once
    instead of after the model has loaded. uvicorn then serves on this socket (``Server.run(sockets=...)``).

    Args:
        host: address to bind (``0.0.0.0``, ``127.0.0.1``, ``::``, a host name).
        port: TCP port; 0 lets the kernel choose (read it back with ``getsockname()``).

    Raises:
        OSError: the address cannot be bound (in use, not local, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def served_model_name(config: EngineConfig, path: str) -> str:
    """``--served-model-name``, else the checkpoint's file stem or folder name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    base = os.path.basename(os.path.normpath(path))
    return os.path.splitext(base)[0] if base.endswith(".gguf") else base


def resolve_model_path(config: EngineConfig) -> str:
    """``config.model.model`` or the packaged default model's path."""
    if config.model.model:
        return config.model.model
    from tokenmill.model.default_model import default_model_path

    return default_model_path()


def create_server_state(config: EngineConfig, engine: AsyncEngine, tokenizer: Any, model_path: str) -> ServerState:
    """Assemble the :class:`ServerState` for a started engine (registers the stat loggers)."""
    from tokenmill.metrics.log_stats import LoggingStatLogger
    from tokenmill.metrics.prometheus import PrometheusStatLogger
    from tokenmill.server.admission import AdmissionController, SLOAdmission
    from tokenmill.server.serving import ServerState
    from tokenmill.server.slo_predictor import SLO

    assert engine.info is not None, "engine must be started"
    name = served_model_name(config, model_path)
    prom = PrometheusStatLogger(name, engine.info.max_model_len)
    for i, info in enumerate(getattr(engine, "core_infos", None) or [engine.info]):
        prom.set_cache_config(i, info.num_kv_blocks, info.block_size, config.cache.kv_cache_dtype,
                              config.cache.enable_prefix_caching)
    log_stats = LoggingStatLogger(config.server.log_stats_interval)
    admission = AdmissionController(config.scheduler.max_num_waiting_requests,
                                    config.scheduler.max_num_waiting_tokens)
    engine.stat_loggers.extend([prom, log_stats, admission])
    slo = None
    if config.scheduler.slo:
        slo = SLOAdmission(SLO.parse(config.scheduler.slo), config.scheduler.scheduling_policy, metrics=prom)
        engine.stat_loggers.append(slo)
        logger.info("SLO-aware admission control: %s (requests predicted to miss it get 429)", slo.slo)
    template = getattr(tokenizer, "chat_template", None)
    lora = None
    if config.model.enable_lora:     # the --lora-modules adapters: the engine core loaded them before "ready"
        from tokenmill.lora.registry import LoRARegistry

        lora = LoRARegistry(name, list(config.model.lora_module_list))
    return ServerState(config=config, engine=engine, tokenizer=tokenizer,
                       chat_template=template if isinstance(template, str) else None, model_name=name,
                       model_path=model_path, max_model_len=engine.info.max_model_len, admission=admission,
                       prometheus=prom, log_stats=log_stats, slo=slo, lora=lora)


# Seconds the API process keeps answering (/health 503, requests 503) after the engine core died,
# before it exits with ENGINE_DEAD_EXIT_CODE so a supervisor restarts it.
ENGINE_DEAD_EXIT_GRACE_S = 2.0
ENGINE_DEAD_EXIT_CODE = 1


def run_server(config: EngineConfig) -> int:
    """Load the tokenizer, start the engine core process and serve HTTP until SIGINT/SIGTERM.

    The core loads the model while this process loads the tokenizer. Returns
    after shutdown; the core process is always stopped (no child is left).

    Returns:
        0 after a normal shutdown; :data:`ENGINE_DEAD_EXIT_CODE` when the
        engine core died (see :func:`serve`); :data:`BIND_FAILED_EXIT_CODE` when
        ``--host``/``--port`` cannot be bound (checked first, before the core starts).

    Raises:
        RuntimeError: the engine core failed to start (message from the core).
        FileNotFoundError / ValueError: bad model or tokenizer path.
    """
    level = envs.TOKENMILL_LOG_LEVEL
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenmill.metrics.memory import maybe_start_tracemalloc

    maybe_start_tracemalloc()   # TOKENMILL_TRACEMALLOC=1: soak diagnostics
    bound_gemm_shape_caches()   # before any engine core or worker is spawned: they inherit it
    try:
        sock = bind_listen_socket(config.server.host, config.server.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", config.server.host, config.server.port, e.strerror or e)
        return BIND_FAILED_EXIT_CODE
    try:
        model_path = resolve_model_path(config)
    except BaseException:
        sock.close()
        raise
    tok_path = config.model.tokenizer or model_path
    from tokenmill.engine.dp_engine import make_async_engine

    engine = make_async_engine(config)  # N engine cores with --data-parallel-size N
    engine.launch()
    try:
        t0 = time.perf_counter()
        import tokenmill.server.app  # noqa: F401 - the HTTP stack, imported while the core boots
        from tokenmill.tokenizer import load_tokenizer

        t1 = time.perf_counter()
        tokenizer = load_tokenizer(tok_path)
        logger.info("API process: HTTP stack imported in %.1f s, tokenizer loaded in %.1f s (while the engine "
                    "core starts)", t1 - t0, time.perf_counter() - t1)
        if "torch" in sys.modules:
            # The API process does no tensor work; keep it from competing with the core.
            import torch

            torch.set_num_threads(1)
            logger.info("API process: torch threads=%d (engine core has its own)", torch.get_num_threads())
        engine.set_tokenizer(tokenizer)
        engine.wait_ready()
    except BaseException:
        engine.shutdown()
        sock.close()
        raise
    return serve(config, engine, tokenizer, model_path, sock=sock)


def serve(config: EngineConfig, engine: Any, tokenizer: Any, model_path: str,
          sock: socket.socket | None = None) -> int:
    """Serve HTTP for a started engine until SIGINT/SIGTERM or the engine core's death.

    When the core process dies, in-flight requests fail with 503 at once (a
    stream that already started gets a 503 error event), ``/health`` answers
    503, and after :data:`ENGINE_DEAD_EXIT_GRACE_S` seconds the server shuts
    down and this returns :data:`ENGINE_DEAD_EXIT_CODE`, so that
    ``tokenmill serve`` exits non-zero and a supervisor restarts it.

    ``sock`` is the listening socket :func:`bind_listen_socket` bound (closed here on return); without
    it one is bound here.

    Returns:
        0 after a signal, :data:`ENGINE_DEAD_EXIT_CODE` after the core died.

    Raises:
        OSError: no ``sock`` and ``--host``/``--port`` cannot be bound (the engine is shut down first).
        RuntimeError: the HTTP server could not start.
        Whatever building the app's state raises (a LoRA module or chat template that cannot be loaded):
            the engine is shut down and ``sock`` closed first.
    """
    import asyncio

    import uvicorn

    from tokenmill.metrics.memory import maybe_start_tracemalloc
    from tokenmill.server.app import build_app

    maybe_start_tracemalloc()
    if sock is None:
        try:
            sock = bind_listen_socket(config.server.host, config.server.port)
        except OSError:
            engine.shutdown()
            raise

    try:    # e.g. a LoRA module or chat template that cannot be loaded: stop the core and free the port first
        state = create_server_state(config, engine, tokenizer, model_path)
        app = build_app(state)
        uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info",
                                   access_log=False, timeout_graceful_shutdown=5, lifespan="on")
        server = _make_server(uv_config, engine)
    except BaseException:
        engine.shutdown()
        sock.close()
        raise
    died: list[str] = []

    def on_dead(reason: str) -> None:
        died.append(reason)
        logger.error("engine core died (%s): answering 503 and exiting with code %d in %.1f s",
                     reason, ENGINE_DEAD_EXIT_CODE, ENGINE_DEAD_EXIT_GRACE_S)
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_GRACE_S, setattr, server, "should_exit", True)

    engine.add_dead_callback(on_dead)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", state.model_name, config.server.host,
                sock.getsockname()[1], state.max_model_len)
    # uvicorn re-raises the signal it captured once its own shutdown is done, with the handler that was
    # there before it: SIGINT's raises KeyboardInterrupt, SIGTERM's default would kill this process
    # (exit 143) before the engine core is stopped below. Ours raises too, so both end here with exit 0.
    previous_sigterm = _raise_on_sigterm()
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        engine.shutdown()
        sock.close()
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    if not server.started:
        raise RuntimeError(f"HTTP server failed to start on {config.server.host}:{config.server.port}")
    return ENGINE_DEAD_EXIT_CODE if died else 0


class _Terminated(Exception):
    """SIGTERM reached the main thread after uvicorn's graceful shutdown (see :func:`serve`)."""


def _raise_on_sigterm() -> Any:
    """Install a SIGTERM handler that raises :class:`_Terminated`; returns the previous handler (None
    off the main thread, where signal handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(sig: int, frame: Any) -> None:
        raise _Terminated()

    return signal.signal(signal.SIGTERM, handler)


def _make_server(config: Any, engine: AsyncEngine) -> Any:
    """A uvicorn.Server that stops the engine first on SIGINT/SIGTERM.

    Open streams then end at once with an error event and ``[DONE]``, so the
    graceful shutdown does not wait for long generations.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.shutdown_threadsafe()
            super().handle_exit(sig, frame)

    return Server(config)
