"""Resumable state: every measurement saved as soon as it is made, keyed by the trial's flags and run number."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.playbook.tune.measure import Measurement


STATE_VERSION = 1


@dataclass
class Trial:
    """One row of the report."""

    index: int
    kind: str              # noise | lever
    lever: str | None
    change: dict[str, Any]
    flags: dict[str, Any]
    why: str
    measurement: Measurement
    verdict: str           # baseline | kept | rejected | failed
    reason: str
    resumed: bool = False


class StateFile:
    """Measurements saved as they are made, keyed by configuration (and run number for the noise runs).

    Raises (on load):
        ValueError: the file belongs to a different session (model, workload, SLO or serve arguments differ).
    """

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.data: dict[str, Any] = {"version": STATE_VERSION, "fingerprint": fingerprint, "measurements": {}}
        if path.exists():
            d = json.loads(path.read_text())
            if d.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} holds a tuning session with other settings (model, workload, SLO or "
                                 f"serve arguments); use another --state-file or delete it")
            self.data = d

    @staticmethod
    def key(flags: dict[str, Any], run: int = 0) -> str:
        return json.dumps(flags, sort_keys=True) + (f"#{run}" if run else "")

    def get(self, key: str) -> Measurement | None:
        d = self.data["measurements"].get(key)
        return Measurement(**d) if d is not None else None

    def put(self, key: str, m: Measurement) -> None:
        self.data["measurements"][key] = asdict(m)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def measured_seconds(self) -> float:
        return sum(float(m.get("duration_s", 0.0)) for m in self.data["measurements"].values())
