"""A job's fingerprint as training workers send it at Join, for tests of joiners that match the
job and joiners that differ from it."""

from __future__ import annotations

JOB = {"model": "tiny", "seed": "0", "lr": "0.003"}
