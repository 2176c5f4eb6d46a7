"""The router's backends: where they are, whether they live, what they serve, how loaded they are.

A backend is any server speaking the OpenAI API (a ``tokenmill serve``, or
vLLM / SGLang). Specs come from ``--backend`` (repeated) or ``--backend-file``::

    http://10.0.0.5:8000
    http://10.0.0.5:8000,kv_events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558

(``kv_events`` / ``replay``: the backend's ``--kv-events-config`` endpoint
and replay endpoint, with ``*`` replaced by the backend's host). A backend
file holds one spec per line (``#`` comments) or a JSON list of objects
``{"url": ..., "kv_events": ..., "replay": ...}``.

:class:`HealthChecker` polls every backend's ``GET /health`` and
``GET /v1/models`` every ``interval`` seconds: a backend that answers
``/health`` with an error status, refuses a connection while proxying, or
fails ``unhealthy_after`` checks in a row by a timeout or a network error
(SGLang's router's failure threshold, default 3: one slow check on a busy
machine is not a death) leaves the rotation; one success brings it back, with
the models it now serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger(__name__)


@dataclass
class BackendSpec:
    """Where a backend is.

    Attributes:
        url: base URL, e.g. ``http://127.0.0.1:8000`` (no trailing slash).
        kv_events: ZMQ address of its KV event publisher (None: no events).
        replay: ZMQ address of its replay socket (None: no replay).
    """

    url: str
    kv_events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> "BackendSpec":
        """Parse ``URL[,kv_events=ADDR][,replay=ADDR]``.

        Raises:
            ValueError: not an http(s) URL, or an unknown option.
        """
        parts = [p.strip() for p in text.strip().split(",") if p.strip()]
        if not parts:
            raise ValueError("empty backend spec")
        url = parts[0].rstrip("/")
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"backend URL must be http(s)://host[:port], got {parts[0]!r}")
        opts: dict[str, str] = {}
        for p in parts[1:]:
            k, sep, v = p.partition("=")
            if not sep or k not in ("kv_events", "replay"):
                raise ValueError(f"backend option must be kv_events=ADDR or replay=ADDR, got {p!r}")
            opts[k] = _local_addr(v, u.hostname)
        return cls(url, opts.get("kv_events"), opts.get("replay"))

    @classmethod
    def from_dict(cls, d: dict) -> "BackendSpec":
        """From a JSON object with ``url`` and optional ``kv_events`` / ``replay``."""
        spec = cls.parse(str(d["url"]))
        host = urlsplit(spec.url).hostname or "127.0.0.1"
        if d.get("kv_events"):
            spec.kv_events = _local_addr(str(d["kv_events"]), host)
        if d.get("replay"):
            spec.replay = _local_addr(str(d["replay"]), host)
        return spec


def _local_addr(addr: str, host: str) -> str:
    """``tcp://*:5557`` (a bind address) → ``tcp://HOST:5557`` (where to connect)."""
    return addr.replace("://*:", f"://{host}:").replace("://0.0.0.0:", f"://{host}:")


def load_backend_file(path: str) -> list[BackendSpec]:
    """Specs from a file: a JSON list, or one spec per line (``#`` starts a comment).

    Raises:
        OSError: unreadable file. ValueError: a bad spec.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return [BackendSpec.from_dict(d) if isinstance(d, dict) else BackendSpec.parse(str(d))
                for d in json.loads(text)]
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(BackendSpec.parse(line))
    return out


@dataclass
class Backend:
    """Live state of one backend.

    Attributes:
        spec: its address.
        index: position in the router's list (stable id).
        healthy: in the rotation.
        models: model ids from its last ``/v1/models``.
        model_cards: per model id, the card fields the router uses: ``parent`` and ``root`` (a LoRA
            adapter's base and folder, vLLM's shape) and ``prefix_cache_key`` (what the adapter's
            block hashes carry on this backend, tokenmill's field; kv_aware hashes with it).
        in_flight: requests the router has open to it.
        active_blocks: KV blocks of its in-flight requests' prompts (router's estimate, blocks).
        prefill_blocks: blocks still to prefill for its in-flight requests that have not
            produced a first byte yet (router's estimate, blocks).
        consecutive_failures: failed health checks in a row.
        last_error: why it was last marked down.
        reported_load: running + waiting requests from its last ``/metrics`` scrape
            (``tokenmill:`` or ``vllm:`` names; None until scraped).
        routed_since_scrape: requests this router sent it since that scrape.
        pool_blocks: its KV pool size in blocks, read from ``cache_config_info``'s ``num_gpu_blocks`` in
            its ``/metrics`` (the smallest over its engine cores; None until read, or when it does not
            export it). Reset when it goes down: a restarted backend may have another pool.
    """

    spec: BackendSpec
    index: int
    healthy: bool = False
    models: list[str] = field(default_factory=list)
    model_cards: dict[str, dict] = field(default_factory=dict)
    in_flight: int = 0
    active_blocks: int = 0
    prefill_blocks: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    last_check: float = 0.0
    reported_load: int | None = None
    routed_since_scrape: int = 0
    down_since: float | None = None   # time.monotonic() when it last left the rotation (None: healthy)
    pool_blocks: int | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def name(self) -> str:
        """Label for metrics and logs (the URL)."""
        return self.spec.url

    def mark_down(self, reason: str) -> None:
        """Take the backend out of the rotation now (a refused connection, a failed check)."""
        if self.healthy:
            logger.warning("backend %s is down: %s", self.url, reason)
        if self.healthy or self.down_since is None:
            self.down_since = time.monotonic()
        self.healthy = False
        self.last_error = reason
        self.pool_blocks = None

    def mark_up(self, models: list[str]) -> None:
        if not self.healthy:
            logger.info("backend %s is up (models %s)", self.url, models)
        self.healthy = True
        self.down_since = None
        self.consecutive_failures = 0
        self.last_error = None
        self.models = models


_LOAD_METRICS = ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting",
                 "vllm:num_requests_running", "vllm:num_requests_waiting")


def parse_load(text: str) -> int:
    """Running + waiting requests in a backend's Prometheus text (all engines and models summed)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(_LOAD_METRICS):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _LOAD_METRICS:
                try:
                    total += float(line.rsplit(" ", 1)[-1])
                except ValueError:
                    pass
    return int(total)


_CACHE_CONFIG_METRICS = ("tokenmill:cache_config_info", "vllm:cache_config_info")


def parse_pool_blocks(text: str) -> int | None:
    """A backend's KV pool size in blocks from its Prometheus text: the ``num_gpu_blocks`` label of
    ``tokenmill:cache_config_info`` (or vLLM's ``vllm:cache_config_info``), the smallest over its engine
    cores (with ``--data-parallel-size`` each core has its own pool). None when absent or unparsable."""
    from prometheus_client.parser import text_string_to_metric_families

    sizes = []
    try:
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name in _CACHE_CONFIG_METRICS:
                    try:
                        n = int(float(sample.labels.get("num_gpu_blocks", "")))
                    except ValueError:
                        continue
                    if n > 0:
                        sizes.append(n)
    except Exception:  # noqa: BLE001 - a malformed exposition: no pool size
        return None
    return min(sizes) if sizes else None


class _SaysUnhealthy(RuntimeError):
    """The backend answered its health check with an error status (it says so itself: out at once)."""


class HealthChecker:
    """Polls ``/health`` and ``/v1/models`` of every backend.

    Args:
        backends: the router's backends.
        client: shared HTTP client.
        interval: seconds between rounds.
        timeout: seconds per check.
        unhealthy_after: checks in a row failed by a timeout or network error before a backend leaves
            the rotation (an error status from ``/health`` takes it out at once).
        api_key: sent as ``Authorization: Bearer`` to ``/v1/models`` if set.
        scrape_metrics: also read ``/metrics`` for running + waiting requests (``least_load --load-source metrics``).
        read_pool_size: read each backend's KV pool size (:func:`parse_pool_blocks`) from ``/metrics``
            until known (kv_aware); a scrape for the load reads it too.
    """

    def __init__(self, backends: list[Backend], client: httpx.AsyncClient, interval: float = 1.0,
                 timeout: float = 2.0, unhealthy_after: int = 3, api_key: str | None = None,
                 scrape_metrics: bool = False, read_pool_size: bool = False) -> None:
        self.scrape_metrics = scrape_metrics
        self.read_pool_size = read_pool_size
        self.backends = backends
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_after = max(1, unhealthy_after)
        self.api_key = api_key
        self._task: asyncio.Task | None = None
        self.on_change = None  # callable(backend) after an up/down transition
        self.on_round = None   # callable() after every round of checks

    async def check(self, b: Backend) -> bool:
        """One check of one backend; updates its state. Returns healthy."""
        was = b.healthy
        b.last_check = time.monotonic()
        try:
            r = await self.client.get(f"{b.url}/health", timeout=self.timeout)
            if r.status_code != 200:
                raise _SaysUnhealthy(f"/health answered {r.status_code}")
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            m = await self.client.get(f"{b.url}/v1/models", timeout=self.timeout, headers=headers)
            if m.status_code != 200:
                raise RuntimeError(f"/v1/models answered {m.status_code}")
            cards = [d for d in m.json().get("data", []) if isinstance(d, dict) and "id" in d]
            models = [str(d["id"]) for d in cards]
            b.model_cards = {str(d["id"]): {k: d.get(k) for k in ("parent", "root", "prefix_cache_key")}
                             for d in cards}
            pool_blocks = b.pool_blocks
            if self.scrape_metrics or (self.read_pool_size and pool_blocks is None):
                r = await self.client.get(f"{b.url}/metrics", timeout=self.timeout)
                if r.status_code == 200:
                    if self.scrape_metrics:
                        b.reported_load = parse_load(r.text)
                        b.routed_since_scrape = 0
                    pool_blocks = parse_pool_blocks(r.text) or pool_blocks
            b.mark_up(models)
            if pool_blocks is not None and pool_blocks != b.pool_blocks:
                logger.info("backend %s: KV pool of %d blocks (from its /metrics)", b.url, pool_blocks)
            b.pool_blocks = pool_blocks
        except Exception as e:  # noqa: BLE001 - any failure is "not healthy"
            b.consecutive_failures += 1
            if b.consecutive_failures >= self.unhealthy_after or not b.healthy or isinstance(e, _SaysUnhealthy):
                b.mark_down(f"{type(e).__name__}: {e}")
        if was != b.healthy and self.on_change is not None:
            self.on_change(b)
        return b.healthy

    async def check_all(self) -> None:
        """Check every backend concurrently."""
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
                if self.on_round is not None:
                    self.on_round()
            except Exception:  # noqa: BLE001 - keep checking
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None
