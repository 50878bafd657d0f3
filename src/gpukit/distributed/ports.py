"""The rendezvous port of a job that exported none: derived from its id, the same on every node.

A scheduler's job (Slurm, Open MPI, SkyPilot) gives every rank its id, so each can compute the
same port without anything exported by hand; two jobs, or two steps of one job, on the same
nodes get different ports.
"""

from __future__ import annotations

import zlib

__all__ = ["DEFAULT_PORT", "PORT_BASE", "PORT_SPAN", "job_port"]

# Derived ports stay below Linux's ephemeral range (32768-60999), where the OS hands out
# ports to outgoing connections, and above the ports services usually register.
PORT_BASE = 15000
PORT_SPAN = 15000
# Each step of a job moves the port by this much: a prime, so the steps of one job take
# PORT_SPAN different ports, and a job's second step meets the first step of a job 7919 later.
_STEP_STRIDE = 7919
DEFAULT_PORT = 29500
"""torch's conventional rendezvous port, used when nothing gives or derives one."""


def job_port(job_id: str, step: str | None = None) -> int:
    """A rendezvous port derived from a job id and step: the same on every node of the step.

    Numeric ids (Slurm's, Open MPI's) map one to one over ``PORT_SPAN`` consecutive jobs, and
    the steps of one job (``SLURM_STEP_ID``) take different ports, so two steps running at
    once never meet in one rendezvous; other ids are hashed.

    >>> job_port("123456"), job_port("123457"), job_port("123456", "1")
    (18456, 18457, 26375)
    """
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    if step:
        number += _STEP_STRIDE * (int(step) if step.isdigit() else zlib.crc32(step.encode()))
    return PORT_BASE + number % PORT_SPAN
