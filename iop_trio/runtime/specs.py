"""What a run may ask for: the checks a run's spec passes before a run is made.

Each raises InvalidRequest, naming the value and the rule, and makes nothing.
"""

from __future__ import annotations

import math
import re

from ..model import (
    InvalidRequest,
    RunSpec,
    TargetSpec,
    prompt_bytes,
    seconds_problem,
    tenant_problem,
)

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


#: The priorities a run may ask for.
PRIORITIES = range(-1000, 1001)


def check_spec(spec: RunSpec) -> None:
    """InvalidRequest if the spec's tenant, priority or queue timeout cannot be."""
    problem = tenant_problem(spec.tenant)
    if problem is not None:
        raise InvalidRequest(problem)
    if isinstance(spec.priority, bool) or spec.priority not in PRIORITIES:
        raise InvalidRequest(
            f"priority must be an integer from -1000 to 1000, not {spec.priority!r}"
        )
    if spec.queue_timeout is not None:
        problem = seconds_problem(spec.queue_timeout)
        if problem is None and math.isinf(spec.queue_timeout):
            problem = "must be finite (leave it out to wait as long as the target allows)"
        if problem is not None:
            raise InvalidRequest(f"queue_timeout {problem}")


def check_run_id(run_id: str) -> None:
    """InvalidRequest unless ``run_id`` is one a caller may choose."""
    if not _RUN_ID.fullmatch(run_id):
        raise InvalidRequest(
            "run_id must be 1-128 characters of A-Z a-z 0-9 _ . : - "
            "and start with a letter or digit"
        )


def check_prompt_size(spec: RunSpec, target: TargetSpec) -> None:
    """InvalidRequest if the prompt is over the target's ``max_prompt_bytes``."""
    if target.max_prompt_bytes is not None:
        size = prompt_bytes(spec)
        if size > target.max_prompt_bytes:
            raise InvalidRequest(
                f"the prompt is {size} bytes, over the {target.max_prompt_bytes} "
                f"(max_prompt_bytes) that {spec.target} takes"
            )
