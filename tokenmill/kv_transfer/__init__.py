"""KV connectors for prefill-decode disaggregation (``--kv-transfer-config``).

* :mod:`.base`: the connector interface (scheduler side + worker side, shaped like vLLM's
  ``KVConnectorBase_V1``) and :class:`~.base.PullConnector`, the consumer-pulls logic both connectors share.
* :mod:`.tcp`: :class:`TcpConnector`, KV blocks between machines over a TCP side channel.
* :mod:`.shared_memory`: :class:`SharedMemoryConnector`, pools on one machine, through ``/dev/shm``.
* :mod:`.params`: the ``kv_transfer_params`` request extra (torch-free).
* :mod:`.framing`: the wire format.

:func:`create_connector` builds the one named by the config (torch is imported then, not here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.config import KVTransferConfig

if TYPE_CHECKING:
    from tokenmill.kv_transfer.base import KVConnectorBase


def create_connector(config: KVTransferConfig, block_size: int) -> "KVConnectorBase":
    """The connector ``config.kv_connector`` names.

    Raises:
        ValueError: an unknown connector (the config validates this already).
        OSError: a producer's side channel cannot bind its port.
    """
    if config.kv_connector == "TcpConnector":
        from tokenmill.kv_transfer.tcp import TcpConnector

        return TcpConnector(config, block_size)
    if config.kv_connector == "SharedMemoryConnector":
        from tokenmill.kv_transfer.shared_memory import SharedMemoryConnector

        return SharedMemoryConnector(config, block_size)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}")
