"""What a run reserves of its target's tokens, counted as it is submitted.

Where a token rule applies to a run (a token budget, a learned capacity, its tenant's
token rate or tokens in flight), it reserves its prompt's tokens plus the most output it
may make; see :meth:`Reservations.reserve`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs

from ..adapters.base import Adapter, AdapterError, AdapterRequest
from ..model import MAX_OUTPUT_TOKENS, RunSpec, TargetSpec, estimate_prompt_tokens
from ..options import output_bound
from .gate import Gate

log = logging.getLogger(__name__)


class Reservations:
    """Counts what each run reserves (see :meth:`reserve`); ``chars_per_token`` estimates
    a prompt's tokens where its target's engine does not count them."""

    def __init__(self, gate: Gate, adapters: Mapping[str, Adapter], chars_per_token: float) -> None:
        self._gate = gate
        self._adapters = adapters
        self.chars_per_token = chars_per_token
        self._tokenizer_failed: set[str] = set()  # targets whose tokenizer failed once

    def __repr__(self) -> str:
        failed = sorted(self._tokenizer_failed)
        return f"<Reservations chars_per_token={self.chars_per_token:g} tokenizer_failed={failed}>"

    async def reserve(
        self, spec: RunSpec, target: TargetSpec
    ) -> tuple[RunSpec, int, tuple[int, bool] | None]:
        """What a run reserves, where a token rule applies to it (a token budget, a learned
        capacity, its tenant's token rate or tokens in flight): its prompt's tokens (the
        engine's tokenizer's count where the target says so, else the node's estimate)
        plus the most output it may make (its own bound, else its target's cap, else the
        target's ``max_output_tokens``). A run that asks for no bound is sent with the
        one it reserved, where its engine takes one, so the reservation bounds what it
        holds. Returns the spec it runs with, the cost (0: no rule applies) and the
        prompt's count with whether it is exact (None: not counted)."""
        if not self._gate.counts_tokens(spec.target, spec.tenant):
            return spec, 0, None
        adapter = self._adapters[target.adapter]
        prompt, exact = await self._prompt_tokens(spec, target, adapter)
        bound = output_bound(target.params_for(spec.options), adapter.output_limit_options)
        if bound is None:
            bound = target.max_output_tokens or MAX_OUTPUT_TOKENS
            if adapter.output_limit_options:
                options = dict(spec.options)
                options[adapter.output_limit_options[0]] = bound
                spec = attrs.evolve(spec, options=options)
        return spec, prompt + bound, (prompt, exact)

    async def _prompt_tokens(
        self, spec: RunSpec, target: TargetSpec, adapter: Adapter
    ) -> tuple[int, bool]:
        """The prompt's tokens and whether the engine counted them (its ``tokenizer``); a
        tokenizer that fails is said once a target, and the estimate is used."""
        chars = target.chars_per_token or self.chars_per_token
        if target.tokenizer != "estimate":
            request = AdapterRequest(
                run_id="", model=target.model, prompt=spec.prompt, messages=spec.messages
            )
            try:
                count = await adapter.count_tokens(request, target.tokenizer)
            except AdapterError as exc:
                if target.name not in self._tokenizer_failed:
                    self._tokenizer_failed.add(target.name)
                    log.warning(
                        "target %s: its engine's tokenizer did not count a prompt (%s); "
                        "prompts are estimated at %g bytes a token until it does",
                        target.name,
                        exc.message,
                        chars,
                    )
                count = None
            else:
                self._tokenizer_failed.discard(target.name)
            if count is not None:
                return count, True
        return estimate_prompt_tokens(spec, chars), False
