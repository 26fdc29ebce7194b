"""Tokens: a run's usage as reported and as settled, the node's estimate of a prompt's
tokens, the token bucket a tenant's rate is, and what an engine says of its load for a
learned concurrency.

Plain values and sans-I/O helpers under :mod:`iop_trio.model` (which re-exports them);
this module imports only attrs, the standard library and :mod:`iop_trio.checks`.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs

from .checks import positive_problem


@attrs.frozen(repr=False)
class Usage:
    """A run's tokens: what its engine reported at the end, and what the node settled.

    An adapter's :class:`~iop_trio.adapters.base.Completion` carries what the engine
    reported (a count it did not report is None). The end of a run that started
    carries both counts (:func:`settle_usage`): the engine's where it reported them,
    else the node's, and then ``prompt_estimated`` / ``completion_estimated`` is True.
    A count may still be None in a record stored before the node settled usage.
    """

    done_reason: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # the count is the node's (the prompt from its size, the completion from the run's
    # deltas), not the engine's report
    prompt_estimated: bool = False
    completion_estimated: bool = False

    @property
    def estimated(self) -> bool:
        """True if either count is the node's estimate rather than the engine's report."""
        return self.prompt_estimated or self.completion_estimated

    def __repr__(self) -> str:
        def count(n: int | None, estimated: bool) -> str:
            return f"{'-' if n is None else n}{'~' if estimated else ''}"

        reason = f" {self.done_reason}" if self.done_reason else ""
        prompt = count(self.prompt_tokens, self.prompt_estimated)
        completion = count(self.completion_tokens, self.completion_estimated)
        return f"<Usage{reason} in={prompt} out={completion}>"


#: Characters of text a token holds, for an estimate where an engine reports no count
#: (about 4 for English text with common tokenizers); ``runtime.chars_per_token`` sets it.
CHARS_PER_TOKEN = 4.0


class Prompted(Protocol):
    """What a run asks its engine: a RunSpec, a RunRecord or an AdapterRequest."""

    @property
    def prompt(self) -> str: ...

    @property
    def messages(self) -> tuple[tuple[str, str], ...]: ...


def prompt_bytes(run: Prompted) -> int:
    """The size of what a run asks the engine, in UTF-8: its prompt and chat messages
    (roles included)."""
    return len(run.prompt.encode()) + sum(
        len(role.encode()) + len(content.encode()) for role, content in run.messages
    )


def estimate_prompt_tokens(run: Prompted | str, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """An estimate of the tokens of ``run``'s prompt (or of a text): its UTF-8 bytes
    (:func:`prompt_bytes`) over ``chars_per_token``, rounded up, so any prompt that is
    not empty counts at least 1; a text of several bytes a character (not Latin) counts
    more, as tokenizers split it finer. ValueError unless ``chars_per_token`` is a
    finite number > 0.

    Who must count tokens before an engine has (admission, a settled usage) asks this,
    so the node's estimates agree with each other."""
    problem = positive_problem(chars_per_token)
    if problem is not None:
        raise ValueError(f"chars_per_token {problem}")
    size = len(run.encode()) if isinstance(run, str) else prompt_bytes(run)
    return math.ceil(size / chars_per_token)


def settle_usage(
    reported: Usage | None, *, prompt: int, completion: int, prompt_exact: bool = False
) -> Usage:
    """The usage the end of a run that started carries: each count the engine
    ``reported`` (exact), else the node's, marked estimated: ``prompt`` (its estimate of
    the run's prompt, :func:`estimate_prompt_tokens`) and ``completion`` (the engine
    tokens of the run's delta events, :attr:`RunEvent.tokens`). A reported count is
    kept even where the node counted otherwise. ``prompt_exact``: the node's ``prompt``
    is the engine tokenizer's own count (asked at admission), not an estimate."""
    reported = reported or Usage()
    prompt_tokens, completion_tokens = reported.prompt_tokens, reported.completion_tokens
    return Usage(
        reported.done_reason,
        prompt if prompt_tokens is None else prompt_tokens,
        completion if completion_tokens is None else completion_tokens,
        prompt_estimated=prompt_tokens is None and not prompt_exact,
        completion_estimated=completion_tokens is None,
    )


@attrs.frozen
class EngineSignals:
    """What an engine says of its own load (its metrics): requests waiting inside it,
    requests it runs (None: not said), the share of its KV cache in use, 0..1 (None:
    not said), and when they were read (the node's clock)."""

    waiting: float
    running: float | None
    kv_usage: float | None
    at: float


@attrs.frozen
class AutoConcurrency:
    """A concurrency learned, not set: between ``minimum`` and ``maximum`` runs at once,
    from the engine's own signals where it exposes them (``engine``), else from the
    latency of its runs (``latency``); see :mod:`iop_trio.runtime.capacity`."""

    minimum: int = 1
    maximum: int = 64


class TokenBucket:
    """A rate, sans I/O: ``rate`` tokens a second refilled, at most ``size`` saved up. It
    starts full. The time is passed in (any clock, as long as it is one clock).

    :meth:`take` is for one request at a time (refused when there is not one token);
    :meth:`charge` takes any amount and may leave a debt, which the refill pays before
    anything else can be taken, and :meth:`credit` gives back (at most up to ``size``).
    """

    def __init__(self, rate: float, size: float, now: float) -> None:
        self.rate = rate
        self.size = size
        self.tokens = size
        self.stamp = now

    def __repr__(self) -> str:
        return f"<TokenBucket {self.tokens:.1f}/{self.size:g} +{self.rate:g}/s>"

    def level(self, now: float) -> float:
        """The tokens there are at ``now`` (negative while a debt is being paid)."""
        self.tokens = min(self.size, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)
        return self.tokens

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds from ``now`` until there are ``amount`` tokens (0 if there are now;
        ``amount`` is taken as at most ``size``)."""
        short = min(amount, self.size) - self.level(now)
        return max(0.0, short / self.rate)

    def take(self, now: float, cost: float = 1.0) -> float | None:
        """Take ``cost`` tokens: None if there were that many, else the seconds until there
        will be (nothing is taken then)."""
        if self.level(now) >= cost:
            self.tokens -= cost
            return None
        return (cost - self.tokens) / self.rate

    def charge(self, cost: float) -> None:
        """Take ``cost`` tokens, even into a debt."""
        self.tokens -= cost

    def credit(self, amount: float) -> None:
        """Give ``amount`` tokens back (a negative amount charges more), up to ``size``."""
        self.tokens = min(self.size, self.tokens + amount)
