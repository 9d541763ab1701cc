"""What a fleet does with a lease: run a command for it, or pretend to (for demos and load).

A renderer is `async (lease) -> RenderResult`. Cancelling it (a lost lease, the end
of a stop's grace period) must stop the work: the command renderer kills its
process group.

A command tells the fleet its origin pushed back (HTTP 429 or 503, with or without
Retry-After) by printing a line `RETRY-AFTER <seconds>` on stderr (any exit status), or by
exiting with `retry_after_exit` (75, EX_TEMPFAIL: "try again later"), which asks for
`retry_after_s` (60 s) unless such a line says how long. The completion then carries
`site_retry_after_s`: the node blocks the key's site that long and hands the key back.

A command that rendered (exit 0) says whether the page changed since its last render by
printing a line `CHANGED yes` or `CHANGED no` on stderr (also `true`/`false`, `1`/`0`; the
last such line counts). The completion then carries `changed`, which the node records and,
where the key's route adapts, learns the key's cadence from. Without the line nothing is
said, and nothing is learned.

The same way, a command tells the fleet its origin answered 404 or 410 (the page is not
there) by printing a line `NOT-FOUND` on stderr (any exit status; `NOT-FOUND 404` or
`NOT-FOUND 410` says which), or by exiting with `not_found_exit` (44). The completion's
outcome is then `not_found`: the node retires the row after a streak of them. A push-back
says more (the site is in trouble, not the page) and wins over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
import shlex
import signal
from collections.abc import Awaitable, Callable

import msgspec

from fleet.messages import Lease, Outcome

KILL_GRACE_S = 2.0
STDERR_TAIL_BYTES = 2_000
RETRY_AFTER_EXIT = 75  # sysexits.h EX_TEMPFAIL
DEFAULT_RETRY_AFTER_S = 60.0
MAX_RETRY_AFTER_S = 86_400.0  # what a node takes (wire.schemas.MAX_SITE_RETRY_AFTER_S)
_RETRY_AFTER_LINE = re.compile(rb"^\s*RETRY-AFTER[:\s]\s*([0-9]+(?:\.[0-9]+)?)\s*$", re.I | re.M)
NOT_FOUND_EXIT = 44  # "4-0-4": no sysexits.h code means it, and none lies in 40-59
_NOT_FOUND_LINE = re.compile(rb"^\s*NOT-FOUND(?:[:\s]\s*(?:404|410))?\s*$", re.I | re.M)


def says_not_found(stderr: bytes) -> bool:
    """Whether the command printed a `NOT-FOUND` line (optionally `NOT-FOUND 404` or 410)."""
    return _NOT_FOUND_LINE.search(stderr) is not None


_CHANGED_LINE = re.compile(rb"^\s*CHANGED[:\s]\s*(yes|no|true|false|1|0)\s*$", re.I | re.M)


def changed_of(stderr: bytes) -> bool | None:
    """The last `CHANGED yes|no` line's answer; None if none."""
    found = _CHANGED_LINE.findall(stderr)
    if not found:
        return None
    return found[-1].lower() in (b"yes", b"true", b"1")


def retry_after_of(stderr: bytes) -> float | None:
    """The last `RETRY-AFTER <seconds>` line's seconds, within (0, a day]; None if none."""
    found = _RETRY_AFTER_LINE.findall(stderr)
    if not found:
        return None
    seconds = float(found[-1])
    return min(seconds, MAX_RETRY_AFTER_S) if seconds > 0 else None


class RenderResult(msgspec.Struct, frozen=True, kw_only=True):
    outcome: Outcome
    detail: str = ""  # for a failure: exit status, the tail of stderr, the exception
    # For `rendered`: when to render next (epoch ms); None leaves it to the row's cadence.
    next_render_at: int | None = None
    # The origin pushed back: block the key's site this long and hand the key back.
    site_retry_after_s: float | None = None
    # For `rendered`: whether the page differed from its last render (None: not known).
    changed: bool | None = None


Renderer = Callable[[Lease], Awaitable[RenderResult]]


class SimulatedRenderer:
    """Render times drawn from a log-normal distribution with the given mean (a render
    farm's shape: most near the median, a long tail), failing with probability p."""

    def __init__(
        self,
        *,
        mean_ms: float = 800.0,
        failure_rate: float = 0.02,
        sigma: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        if mean_ms < 0 or not 0.0 <= failure_rate <= 1.0:
            raise ValueError("mean_ms must be >= 0 and failure_rate within [0, 1]")
        self.mean_ms = mean_ms
        self.failure_rate = failure_rate
        self._sigma = sigma
        # a log-normal's mean is exp(mu + sigma^2 / 2)
        self._mu = math.log(mean_ms) - sigma * sigma / 2 if mean_ms > 0 else 0.0
        self._rng = rng or random.Random()

    def draw_ms(self) -> float:
        if self.mean_ms <= 0:
            return 0.0
        return self._rng.lognormvariate(self._mu, self._sigma)

    async def __call__(self, lease: Lease) -> RenderResult:
        await asyncio.sleep(self.draw_ms() / 1000)
        if self._rng.random() < self.failure_rate:
            return RenderResult(outcome="failed", detail="simulated failure")
        return RenderResult(outcome="rendered")


def command_arguments(template: str, lease: Lease) -> list[str]:
    """The template split shell-style, then {key} / {route} substituted per argument.

    No shell ever sees the key: a URL from a sitemap is untrusted text, and as one
    argv element it cannot become a second command.
    """
    arguments = shlex.split(template)
    if not arguments:
        raise ValueError("the --exec command is empty")
    return [arg.replace("{key}", lease.key).replace("{route}", lease.route) for arg in arguments]


class CommandRenderer:
    """Runs a command per key; exit 0 is rendered, `gone_exit` is gone, else failed; a
    `RETRY-AFTER <seconds>` line on stderr, or exit `retry_after_exit`, is the origin
    pushing back, and a `NOT-FOUND` line or exit `not_found_exit` is not_found; a
    `CHANGED yes|no` line on a rendered one says whether the page changed (module note)."""

    def __init__(
        self,
        template: str,
        *,
        timeout_s: float = 120.0,
        gone_exit: int | None = 10,
        retry_after_exit: int | None = RETRY_AFTER_EXIT,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        not_found_exit: int | None = NOT_FOUND_EXIT,
    ) -> None:
        if "{key}" not in template:
            raise ValueError('the --exec command must contain {key}, e.g. "render.sh {key}"')
        shlex.split(template)  # raises ValueError on unbalanced quotes, before any claim
        self.template = template
        self.timeout_s = timeout_s
        self.gone_exit = gone_exit
        self.retry_after_exit = retry_after_exit
        if not 0 < retry_after_s <= MAX_RETRY_AFTER_S:
            raise ValueError(f"the retry-after default must be in (0, {MAX_RETRY_AFTER_S:g}] s")
        self.retry_after_s = retry_after_s
        self.not_found_exit = not_found_exit

    async def __call__(self, lease: Lease) -> RenderResult:
        process = await asyncio.create_subprocess_exec(
            *command_arguments(self.template, lease),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, so a kill reaches its children
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                _, stderr = await process.communicate()
        except TimeoutError:
            await _kill(process)
            return RenderResult(outcome="failed", detail=f"timed out after {self.timeout_s:g} s")
        except asyncio.CancelledError:
            await _kill(process)
            raise
        status = process.returncode
        pushed_back = retry_after_of(stderr)
        if pushed_back is None and status == self.retry_after_exit:
            pushed_back = self.retry_after_s
        if pushed_back is not None:
            return RenderResult(
                outcome="failed",
                detail=f"the origin asked to wait {pushed_back:g} s (exit {status})",
                site_retry_after_s=pushed_back,
            )
        if says_not_found(stderr) or (
            self.not_found_exit is not None and status == self.not_found_exit
        ):
            return RenderResult(
                outcome="not_found", detail=f"the origin answered not found (exit {status})"
            )
        if status == 0:
            return RenderResult(outcome="rendered", changed=changed_of(stderr))
        if self.gone_exit is not None and status == self.gone_exit:
            return RenderResult(outcome="gone")
        tail = stderr[-STDERR_TAIL_BYTES:].decode("utf-8", "replace").strip()
        return RenderResult(outcome="failed", detail=f"exit {status}: {tail}".strip(": "))


async def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(KILL_GRACE_S):
            await process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
