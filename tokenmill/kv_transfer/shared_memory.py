"""``SharedMemoryConnector``: KV blocks between engines on one machine, through ``/dev/shm``.

The producer copies a finished ``do_remote_decode`` request's prompt blocks, layer by layer, into a
file in a RAM-backed directory (``kv_connector_extra_config.shm_dir``, default
``/dev/shm/tokenmill-kv``; framing: :mod:`tokenmill.kv_transfer.framing`) on a background thread,
then frees the blocks at once: the file holds the KV, not the pool. The consumer waits for the file
(it is renamed into place only when complete), reads it layer by layer into its own blocks and
deletes it. A file nobody reads is deleted after ``abort_timeout_s``, or at once on a release
(:meth:`SharedMemoryConnector.release`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tokenmill.config import KVTransferConfig
from tokenmill.kv_transfer.base import KVTransferError, LoadSpec, PullConnector
from tokenmill.kv_transfer.files import unlink_quietly, write_atomically
from tokenmill.kv_transfer.framing import encode_msg, raw_header, read_msg, read_raw_into

logger = logging.getLogger(__name__)

_POLL_S = 0.002


def default_shm_dir() -> str:
    """``/dev/shm/tokenmill-kv`` where ``/dev/shm`` exists, else a folder in the temp directory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "tokenmill-kv")


class SharedMemoryConnector(PullConnector):
    """KV transfer through files in shared memory (see the module docstring).

    Args:
        config: ``--kv-transfer-config``; ``kv_connector_extra_config.shm_dir`` overrides the folder.
        block_size: tokens per KV block.
    """

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self.shm_dir = os.path.join(config.kv_connector_extra_config.get("shm_dir") or default_shm_dir(),
                                    self.engine_id)
        if config.is_producer:
            os.makedirs(self.shm_dir, mode=0o700, exist_ok=True)
        self._files: dict[str, tuple[str, float]] = {}   # req id -> (path, deadline)
        self._drop_after_write: set[str] = set()          # released while its file was being written
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-shm-save")

    def path_for(self, req_id: str) -> str:
        """The file of ``req_id``'s KV (request ids may hold any character: the name is a hash)."""
        return os.path.join(self.shm_dir, hashlib.sha1(req_id.encode()).hexdigest() + ".kv")

    def _remote_address(self, req_id: str) -> dict[str, Any]:
        return {"remote_shm_path": self.path_for(req_id), "remote_host": None, "remote_port": None}

    # -- producer --------------------------------------------------------------
    def _publish(self, req_id: str, block_ids: list[int]) -> None:
        # the copy runs on a thread: the blocks stay held (nothing overwrites them) until it is done
        self._writer.submit(self._write, req_id, list(block_ids))

    def _write(self, req_id: str, block_ids: list[int]) -> None:
        path = self.path_for(req_id)
        nbytes = 0
        with self._lock:
            if not self._begin_transfer_locked(req_id):
                return      # released before the copy started: the blocks are already being freed

        def write(tmp: str) -> None:
            nonlocal nbytes
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
            with open(tmp, "wb") as f:
                f.write(encode_msg({"geometry": self.geometry(), "block_ids": block_ids}))
                for kv in self.kv_caches:
                    data = kv.index_select(1, idx).cpu().contiguous().view(torch.uint8).numpy()
                    f.write(raw_header(data.nbytes))
                    f.write(memoryview(data).cast("B"))
                    nbytes += data.nbytes

        try:
            write_atomically(path, write)
            with self._lock:
                drop = req_id in self._drop_after_write
                self._drop_after_write.discard(req_id)
                if not drop:
                    self._files[req_id] = (path, time.monotonic() + self.abort_timeout_s)
            if drop:
                unlink_quietly(path)
        except OSError as e:       # the partial file is gone already
            logger.warning("writing the KV of request %s to %s failed: %s", req_id, path, e)
            with self._lock:
                self._drop_after_write.discard(req_id)
        finally:
            self._end_transfer(req_id, nbytes)    # the pool's blocks are no longer needed either way

    def release(self, req_id: str, engine_id: str | None = None) -> bool:
        """Free ``req_id``'s kept KV now: its blocks if the copy to the file has not started, else the
        file (deleted now, or as soon as the copy ends). See :meth:`PullConnector.release`."""
        if engine_id is not None and engine_id != self.engine_id:
            return False
        if super().release(req_id, engine_id):
            return True
        with self._lock:
            entry = self._files.pop(req_id, None)
            if entry is None:
                if req_id not in self._in_transfer:
                    return False
                self._drop_after_write.add(req_id)
            self.stats.num_released += 1
        if entry is not None:
            unlink_quietly(entry[0])
        logger.info("request %s: KV released (no consumer will read it); deleting its file", req_id)
        return True

    def get_finished(self):  # noqa: ANN201 - see PullConnector.get_finished
        now = time.monotonic()
        with self._lock:
            stale = [(rid, p) for rid, (p, d) in self._files.items() if d <= now]
            for rid, _ in stale:
                del self._files[rid]
        for rid, p in stale:
            if os.path.exists(p):
                logger.warning("request %s: no consumer read its KV file within %.0f s; deleting it",
                               rid, self.abort_timeout_s)
                self.stats.num_expired += 1
                unlink_quietly(p)
        return super().get_finished()

    # -- consumer --------------------------------------------------------------
    def _load(self, spec: LoadSpec, cancel: threading.Event, deadline: float) -> int:
        path = spec.params.get("remote_shm_path")
        if not path:
            raise KVTransferError("kv_transfer_params lack remote_shm_path")
        while not os.path.exists(path):
            if cancel.is_set():
                raise KVTransferError("cancelled")
            if time.monotonic() > deadline:
                raise KVTransferError(f"KV file {path} did not appear in time")
            time.sleep(_POLL_S)
        try:
            with open(path, "rb") as f:
                head = read_msg(f)
                self.check_geometry(head.get("geometry") or {})
                stored = head.get("block_ids") or []
                pos = {b: i for i, b in enumerate(stored)}
                try:
                    rows = [pos[b] for b in spec.remote_block_ids]
                except KeyError:
                    raise KVTransferError("the KV file lacks some of the requested blocks") from None
                kv0 = self.kv_caches[0]
                buf = torch.empty((2, len(stored), *kv0.shape[2:]), dtype=kv0.dtype)
                view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
                src = torch.tensor(rows, dtype=torch.long)
                dst = torch.tensor(spec.local_block_ids, dtype=torch.long, device=kv0.device)
                total = 0
                for kv in self.kv_caches:
                    if cancel.is_set():
                        raise KVTransferError("cancelled")
                    if time.monotonic() > deadline:
                        raise KVTransferError("KV transfer timed out")
                    read_raw_into(f, view)
                    kv.index_copy_(1, dst, buf.index_select(1, src).to(kv.device))
                    total += len(rows) * len(view) // max(1, len(stored))
        finally:
            unlink_quietly(path)     # read once: the consumer owns it now
        return total

    def shutdown(self) -> None:
        super().shutdown()
        self._writer.shutdown(wait=True)
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for p, _ in files:
            unlink_quietly(p)
        try:
            os.rmdir(self.shm_dir)
        except OSError:
            pass
