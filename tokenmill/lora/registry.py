"""The API process's adapter table: served names -> :class:`LoRARequest` (torch-free).

Ids: the ``--lora-modules`` entries get ``1 .. N`` in their order (the engine core loads the same
list at start-up and numbers it the same way); runtime loads continue from ``N + 1``; an id is
never reused, so a new adapter under an old name never hits the old one's cached KV blocks.
"""

from __future__ import annotations

from tokenmill.lora.request import LoRAModule, LoRARequest, adapter_content_hash


def startup_requests(modules: list[LoRAModule], content_hash: bool = False) -> list[LoRARequest]:
    """The ``--lora-modules`` entries as :class:`LoRARequest` with ids ``1 .. N`` (both processes agree);
    ``content_hash``: read each folder's :func:`~tokenmill.lora.request.adapter_content_hash` (the API
    process does: its requests carry the key block hashes use)."""
    return [LoRARequest(m.name, i + 1, m.path, m.base_model_name,
                        adapter_content_hash(m.path) if content_hash else None) for i, m in enumerate(modules)]


class LoRARegistry:
    """Adapters the server accepts in a request's ``model``.

    Args:
        base_model_name: the served base model's name (an adapter may not take it).
        modules: the ``--lora-modules`` entries (already loaded by the engine core).
    """

    def __init__(self, base_model_name: str, modules: list[LoRAModule] = ()) -> None:
        self.base_model_name = base_model_name
        self._by_name: dict[str, LoRARequest] = {r.lora_name: r for r in startup_requests(list(modules), True)}
        self._next_id = len(self._by_name) + 1

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served under ``name``, None when there is none."""
        return self._by_name.get(name)

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def new_request(self, name: str, path: str, content_hash: str | None | bool = True) -> LoRARequest:
        """A :class:`LoRARequest` with a fresh id for a runtime load (not registered yet: :meth:`add`);
        ``content_hash``: the folder's :func:`~tokenmill.lora.request.adapter_content_hash` if the caller
        read it already (True: read it here).

        Raises:
            ValueError: the name is taken (by an adapter or the base model) or empty.
        """
        if not name or not path:
            raise ValueError("lora_name and lora_path must be non-empty")
        if name == self.base_model_name:
            raise ValueError(f"'{name}' is the base model's name")
        if name in self._by_name:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        digest = adapter_content_hash(path) if content_hash is True else (content_hash or None)
        req = LoRARequest(name, self._next_id, path, content_hash=digest)
        self._next_id += 1
        return req

    def add(self, req: LoRARequest) -> None:
        """Serve ``req`` under its name."""
        self._by_name[req.lora_name] = req

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving ``name``; the removed request (None when unknown)."""
        return self._by_name.pop(name, None)
