"""Fault injection: ``crash@STEP:rank=R``, ``hang@STEP:rank=R``,
``slow@STEP:rank=R:FACTOR[:for=SECONDS]``, ``slow@STEP:rank=R:SECONDSs``, ``nan@STEP:rank=R``,
``spike@STEP:rank=R:FACTOR``, ``crash@recover:rank=R``, ``tamper@serve:rank=R`` and
``random:every=S[:seed=N]`` (the launcher kills a random member every S seconds).

``nan@STEP:rank=R`` makes the step's loss NaN on rank R, and its model's parameters with it (a
step whose update went wrong): the member reports the non-finite step (``train.anomaly``) and
waits for the control plane to roll the job back.

``spike@STEP:rank=R:FACTOR`` (e.g. ``spike@25:rank=1:10``) multiplies rank R's model parameters
by FACTOR once STEP is done (and backed up): an update that went wrong without turning
non-finite. Nothing is reported by the rank; the job's loss spikes from the next step on, and
the control plane finds the spike in the job's step records (the policy's ``loss_spike_k``).

``slow@STEP:rank=R:FACTOR`` (e.g. ``slow@20:rank=1:1.5``, or ``1.5x``) makes the process that
has rank R at step STEP slower from that step on, until it ends (or for ``for=SECONDS`` of wall
time): after each step it sleeps (FACTOR - 1) times the step's compute time and reports the
sleep as compute (a slower device). A spare that takes its rank later is not slow.
``slow@STEP:rank=R:SECONDSs`` (e.g. ``2s``) is one slow step: the rank sleeps SECONDS once
after STEP (a hiccup).

``stall@STEP:rank=R`` makes the rank's loop stop after STEP for good, its process alive and its
heartbeats going on (a data loader on a hung filesystem, a kernel that never returns): its
peers wait for it in the next step's collectives, and only where it is in its steps shows it
(docs/design.md, "Stalled steps").

``crash@recover:rank=R`` fires in the member that had rank R when it receives a reallocation,
before it acks: a second fault while the job recovers (and, when that member holds a copy the
plan restores from, the loss of a holder during the restore).

Step faults run inside the member when it finishes the step (``ELASTIC_FAULTS`` carries them
from the launcher): a crash is ``SIGKILL`` of itself (nothing is flushed, like a real crash), a
hang is ``SIGSTOP`` (the process stays, silent), a stall blocks the loop (the process stays,
beating), a slow step sleeps. Each fires once per job:
the member claims it first with an exclusive marker file in ``ELASTIC_FAULTS_STATE`` (the
launcher's directory), so a rank that replays the step after a recovery does not fire it again.

``tamper@serve:rank=R`` makes the member that first had rank R a forging holder, an insider: its
peer store serves every copy it is asked for with the weights multiplied by 50, re-encoded as a
well-formed snapshot (a valid crc32 trailer) under a valid MAC (it has the job's secret), and
announces the forged bytes' own digest. Only the digest the control plane recorded tells.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

#: Faults to inject, comma-separated, in the forms of ``elasticctl run --fault``
#: (``crash@STEP:rank=R``, ``hang@STEP:rank=R``, ...).
FAULTS_ENV = "ELASTIC_FAULTS"
#: The launcher's directory where a member marks a fault as fired (each fires once per job).
FAULTS_STATE_ENV = "ELASTIC_FAULTS_STATE"
#: The ``step`` of a fault that fires on a reallocation rather than after a step.
RECOVER = -1
#: The ``step`` of a fault that acts on every copy the peer store serves (``tamper``).
SERVE = -2
#: What a forging holder multiplies every floating-point tensor by.
FORGE_FACTOR = 50.0

_STEP_FAULT = re.compile(
    r"^(?P<kind>crash|hang|stall|slow|spike|nan|tamper)@(?P<step>\d+|recover|serve):rank=(?P<rank>\d+)"
    r"(?::(?P<seconds>\d+(\.\d+)?)(?P<unit>[sx])?)?(?::for=(?P<for>\d+(\.\d+)?))?$"
)
#: The largest slowdown factor a ``slow`` fault takes.
MAX_FACTOR = 100.0
#: The largest factor a ``spike`` multiplies parameters by.
MAX_SPIKE = 1e6
_RANDOM = re.compile(r"^random:every=(?P<every>\d+(\.\d+)?)(?::seed=(?P<seed>\d+))?$")


class FaultSpecError(ValueError):
    """A fault specification that does not parse."""


@dataclass(frozen=True, slots=True)
class StepFault:
    """A fault a rank injects into itself when it finishes ``step`` (``RECOVER``: when it
    receives a reallocation)."""

    kind: str
    step: int
    rank: int
    #: A one-step ``slow``: how long the rank sleeps once.
    seconds: float = 0.0
    #: A lasting ``slow``: how much slower the rank's steps become (0: a one-step one); a
    #: ``spike``: what the rank's parameters are multiplied by.
    factor: float = 0.0
    #: A lasting ``slow``'s wall time (None: until the process ends).
    duration: float | None = None

    def __str__(self) -> str:
        tail = ""
        if self.kind == "spike":
            tail = f":{self.factor:g}"
        elif self.kind == "slow" and self.factor:
            tail = f":{self.factor:g}x"
            if self.duration is not None:
                tail += f":for={self.duration:g}"
        elif self.kind == "slow":
            tail = f":{self.seconds:g}s"
        when = {RECOVER: "recover", SERVE: "serve"}.get(self.step, str(self.step))
        return f"{self.kind}@{when}:rank={self.rank}{tail}"


@dataclass(slots=True)
class Slowdown:
    """A lasting ``slow`` fault that fired in this process: each step it sleeps
    ``factor - 1`` times the step's compute time, until ``until`` (monotonic; None: never)."""

    factor: float
    until: float | None = None

    def pause(self, compute_s: float, now: float) -> float:
        """How long to sleep after a step that computed for ``compute_s``."""
        if self.until is not None and now >= self.until:
            return 0.0
        return max(0.0, (self.factor - 1.0) * compute_s)


@dataclass(frozen=True, slots=True)
class RandomFaults:
    """The launcher kills a random member every ``every`` seconds (seeded)."""

    every: float
    seed: int = 0


def parse(spec: str) -> StepFault | RandomFaults:
    """Parse one ``--fault`` value; raise ``FaultSpecError`` saying what is expected."""
    text = spec.strip()
    if m := _STEP_FAULT.match(text):
        kind = m["kind"]
        value = float(m["seconds"]) if m["seconds"] else 0.0
        if kind == "spike":
            if not m["step"].isdigit() or m["for"] or m["unit"] or not 1.0 < value <= MAX_SPIKE:
                raise FaultSpecError(
                    f"{spec!r}: a spike fires after a step and needs its factor, above 1 and at"
                    f" most {MAX_SPIKE:g} (spike@STEP:rank=R:10)"
                )
            return StepFault(kind, int(m["step"]), int(m["rank"]), factor=value)
        if kind != "slow" and (m["seconds"] or m["for"]):
            raise FaultSpecError(f"{spec!r}: only a slow step takes seconds")
        seconds = factor = 0.0
        duration = float(m["for"]) if m["for"] else None
        if kind == "slow" and m["unit"] == "s":
            if value <= 0:
                raise FaultSpecError(f"{spec!r}: a slow step needs its seconds (slow@S:rank=R:2s)")
            if duration is not None:
                raise FaultSpecError(f"{spec!r}: one slow step (SECONDSs) takes no for=")
            seconds = value
        elif kind == "slow":
            if not 1.0 < value <= MAX_FACTOR:
                raise FaultSpecError(
                    f"{spec!r}: a slowdown needs its factor, above 1 and at most {MAX_FACTOR:g}"
                    " (slow@STEP:rank=R:1.5[:for=SECONDS])"
                )
            if duration is not None and duration <= 0:
                raise FaultSpecError(f"{spec!r}: for= must be > 0 seconds")
            factor = value
        if m["step"] == "recover" and kind != "crash":
            raise FaultSpecError(f"{spec!r}: only a crash can fire on recovery")
        if (m["step"] == "serve") != (kind == "tamper"):
            raise FaultSpecError(f"{spec!r}: a holder tampers with what it serves (tamper@serve)")
        step = {"recover": RECOVER, "serve": SERVE}.get(m["step"]) or int(m["step"])
        return StepFault(kind, step, int(m["rank"]), seconds, factor, duration)
    if m := _RANDOM.match(text):
        every = float(m["every"])
        if every <= 0:
            raise FaultSpecError(f"{spec!r}: every must be > 0 seconds")
        return RandomFaults(every, int(m["seed"] or 0))
    raise FaultSpecError(
        f"{spec!r}: expected crash@STEP:rank=R, hang@STEP:rank=R, stall@STEP:rank=R,"
        " slow@STEP:rank=R:FACTOR[:for=SECONDS], slow@STEP:rank=R:SECONDSs, nan@STEP:rank=R,"
        " spike@STEP:rank=R:FACTOR,"
        " crash@recover:rank=R, tamper@serve:rank=R or random:every=SECONDS[:seed=N]"
    )


def encode(faults: list[StepFault]) -> str:
    """The ``ELASTIC_FAULTS`` value carrying ``faults`` to the members."""
    return ",".join(str(f) for f in faults)


def from_env(env: dict[str, str] | None = None) -> list[StepFault]:
    """The step faults the launcher passed to this member."""
    text = (os.environ if env is None else env).get(FAULTS_ENV, "")
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        fault = parse(part)
        if isinstance(fault, StepFault):
            out.append(fault)
    return out


def claim(fault: StepFault, state_dir: str | None) -> bool:
    """Take the right to fire ``fault`` (once per job); without a directory, always."""
    if not state_dir:
        return True
    marker = os.path.join(state_dir, f"fired-{str(fault).replace(':', '_').replace('=', '-')}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def poisons(faults: list[StepFault], step: int, rank: int, state_dir: str | None = None) -> bool:
    """Whether ``step``'s loss is to be NaN on ``rank`` (``nan@STEP``; claimed once per job)."""
    return any(
        f.kind == "nan" and f.step == step and f.rank == rank and claim(f, state_dir)
        for f in faults
    )


def spike(faults: list[StepFault], step: int, rank: int, state_dir: str | None = None) -> float:
    """The factor ``rank``'s parameters are multiplied by after ``step`` (``spike@STEP``;
    claimed once per job; 1.0: none)."""
    for fault in faults:
        if (
            fault.kind == "spike"
            and fault.step == step
            and fault.rank == rank
            and claim(fault, state_dir)
        ):
            return fault.factor
    return 1.0


def slowdown(
    faults: list[StepFault], step: int, rank: int, state_dir: str | None, now: float
) -> Slowdown | None:
    """The lasting slowdown that starts at ``step`` for ``rank`` (claimed: once per job), if
    any; ``now`` is the monotonic clock its ``for=`` counts from."""
    for fault in faults:
        if (
            fault.kind == "slow"
            and fault.factor
            and fault.step == step
            and fault.rank == rank
            and claim(fault, state_dir)
        ):
            until = None if fault.duration is None else now + fault.duration
            return Slowdown(fault.factor, until)
    return None


def pause(faults: list[StepFault], step: int, rank: int, state_dir: str | None) -> float:
    """The seconds of a one-step ``slow`` due at ``step`` for ``rank`` (claimed: once per
    job; 0.0: none)."""
    return sum(
        fault.seconds
        for fault in faults
        if fault.kind == "slow"
        and not fault.factor
        and fault.step == step
        and fault.rank == rank
        and claim(fault, state_dir)
    )


def inject(faults: list[StepFault], step: int, rank: int, state_dir: str | None = None) -> None:
    """Carry out the faults due at ``step`` (``RECOVER`` on a reallocation) for ``rank`` (a
    crash does not return); slow steps are ``pause``'s and ``slowdown``'s, a ``nan`` fault
    is the step's own (``poisons``) and a ``spike`` the parameters' (``spike``)."""
    for fault in faults:
        if fault.step != step or fault.rank != rank or fault.kind in ("slow", "nan", "spike"):
            continue
        if not claim(fault, state_dir):
            continue
        if fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "stall":
            while True:  # the loop never comes back; the heartbeat thread goes on
                time.sleep(3600)
        else:
            from rank_runtime import trace

            trace.mark("crash", time.time(), 0.0, step=step, rank=rank)
            os.kill(os.getpid(), signal.SIGKILL)


def tampers(faults: list[StepFault], rank: int) -> bool:
    """Whether the member of ``rank`` is to serve forged copies (``tamper@serve``)."""
    return any(f.kind == "tamper" and f.rank == rank for f in faults)


def forge(data: bytes | bytearray) -> bytes:
    """A forged copy of a serialized snapshot: every floating-point tensor times
    ``FORGE_FACTOR``, re-encoded with a valid checksum trailer (crc32 is no defence)."""
    import torch

    from rank_runtime.snapshot import HotSnapshot, from_bytes

    restored = from_bytes(data)

    def scaled(node: object) -> object:
        if isinstance(node, torch.Tensor):
            return node * FORGE_FACTOR if node.is_floating_point() else node
        if isinstance(node, dict):
            out = type(node)()
            for key, value in node.items():
                out[key] = scaled(value)
            return out
        if isinstance(node, list | tuple):
            return type(node)(scaled(v) for v in node)
        return node

    hot = HotSnapshot()
    hot.take(restored.step, scaled(restored.state))
    return hot.to_bytes(restored.step)
