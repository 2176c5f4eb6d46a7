"""Engine-core process tuning: the busy-machine warning."""

from __future__ import annotations

import logging

from tokenmill.model import process_tuning


def test_warns_when_the_load_exceeds_the_cpus(monkeypatch, caplog):
    monkeypatch.setattr(process_tuning.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(process_tuning.os, "getloadavg", lambda: (27.0, 20.0, 10.0))
    with caplog.at_level(logging.WARNING, logger=process_tuning.logger.name):
        assert process_tuning.warn_if_busy(2)
    assert "TOKENMILL_NUM_THREADS=1" in caplog.text and "27.0" in caplog.text
    monkeypatch.setattr(process_tuning.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert not process_tuning.warn_if_busy(2)
