"""The one error table (protocol/errors.py) and the listing query (model.RunQuery)."""

from __future__ import annotations

import pytest

from iop_trio.model import (
    InvalidRequest,
    NodeUnavailable,
    RunQuery,
    RunRecord,
    RunStatus,
    UnknownRun,
    UnknownTarget,
)
from iop_trio.protocol import pb
from iop_trio.protocol.convert import query_from_pb, query_to_pb
from iop_trio.protocol.errors import (
    ERROR_RULES,
    NODE_RETRY_AFTER,
    Forbidden,
    NodeGone,
    NoNode,
    RateLimited,
    Refusal,
    RemoteError,
    ReplyTimeout,
    SessionClosed,
    TooLate,
    TooLateToRelay,
    http_answer,
    refusal_for,
)
from iop_trio.store import StoreUnavailable


@pytest.mark.parametrize(
    ("failure", "kind", "expected"),
    [
        (
            UnknownTarget("x"),
            "run_request",
            Refusal(pb.ERROR_CODE_UNKNOWN_TARGET, "unknown target 'x'"),
        ),
        (UnknownRun("r"), "get_run", Refusal(pb.ERROR_CODE_UNKNOWN_RUN, "unknown run 'r'")),
        (InvalidRequest("bad"), "run_request", Refusal(pb.ERROR_CODE_INVALID, "bad")),
        (NodeUnavailable("draining"), "", Refusal(pb.ERROR_CODE_UNAVAILABLE, "draining", 5.0)),
        (StoreUnavailable("full"), "", Refusal(pb.ERROR_CODE_STORE_UNAVAILABLE, "full", 5.0)),
        (TooLate("late"), "run_request", Refusal(pb.ERROR_CODE_UNAVAILABLE, "late", 1.0)),
        (
            TooLateToRelay("late"),
            "get_run",
            Refusal(pb.ERROR_CODE_UNAVAILABLE, "late", NODE_RETRY_AFTER),
        ),
        (NodeGone("gone"), "", Refusal(pb.ERROR_CODE_UNAVAILABLE, "gone", NODE_RETRY_AFTER)),
        (NoNode("none"), "run_request", Refusal(pb.ERROR_CODE_UNKNOWN_TARGET, "none")),
        (NoNode("none"), "cancel_run", Refusal(pb.ERROR_CODE_UNKNOWN_RUN, "none")),
        (
            RemoteError(pb.ERROR_CODE_RATE_LIMITED, "slow down", 3.0),
            "",
            Refusal(pb.ERROR_CODE_RATE_LIMITED, "slow down", 3.0),
        ),
        (RateLimited("over", 0.5), "", Refusal(pb.ERROR_CODE_RATE_LIMITED, "over", 0.5)),
        (
            SessionClosed("cut"),
            "",
            Refusal(pb.ERROR_CODE_UNAVAILABLE, "node lost: cut", NODE_RETRY_AFTER),
        ),
        (
            ReplyTimeout("slow"),
            "",
            Refusal(pb.ERROR_CODE_UNAVAILABLE, "node lost: slow", NODE_RETRY_AFTER),
        ),
        (Forbidden("no"), "", Refusal(pb.ERROR_CODE_FORBIDDEN, "no")),
    ],
)
def test_each_failure_has_its_answer(failure, kind, expected):
    assert refusal_for(failure, kind) == expected


def test_a_failure_no_rule_names_is_a_bug():
    assert refusal_for(RuntimeError("bug"), "run_request") is None
    assert refusal_for(KeyError("k")) is None


def test_a_subclass_rule_comes_before_its_base():
    # a rule for a subclass after one for its base (for any request) would never match
    for i, rule in enumerate(ERROR_RULES):
        for later in ERROR_RULES[i + 1 :]:
            assert not (
                issubclass(later.failure, rule.failure)
                and later.failure is not rule.failure
                and not rule.requests
            ), (rule, later)


def test_the_door_answers_each_code():
    assert http_answer(pb.ERROR_CODE_UNKNOWN_TARGET).status == 404
    assert http_answer(pb.ERROR_CODE_UNKNOWN_TARGET).param == "model"
    assert http_answer(pb.ERROR_CODE_RATE_LIMITED).kind == "rate_limit_error"
    other = http_answer(pb.ERROR_CODE_INTERNAL)
    assert (other.status, other.kind, other.name) == (502, "server_error", "node_error")


def test_reprs_say_what_they_are():
    assert repr(ERROR_RULES[0]) == "<ErrorRule UnknownTarget -> ERROR_CODE_UNKNOWN_TARGET>"
    assert "retry_after=3.0" in repr(RemoteError(pb.ERROR_CODE_UNAVAILABLE, "x", 3.0))
    assert repr(RunQuery()) == "<RunQuery limit=100>"
    assert repr(RunQuery([RunStatus.QUEUED], tenant="")) == (
        "<RunQuery statuses=['queued'] tenant='' limit=100>"
    )


def _record(run_id: str, status: RunStatus, target: str = "t", tenant: str = "") -> RunRecord:
    return RunRecord(run_id, target, status, False, 0.0, tenant=tenant)


def test_a_query_matches_by_each_of_its_fields():
    queued = _record("alice:1", RunStatus.QUEUED, tenant="acme")
    assert RunQuery().matches(queued)
    assert RunQuery(statuses=[RunStatus.QUEUED, RunStatus.RUNNING]).matches(queued)
    assert not RunQuery(statuses=[RunStatus.RUNNING]).matches(queued)
    assert not RunQuery(target="u").matches(queued)
    assert RunQuery(tenant="acme").matches(queued)
    assert not RunQuery(tenant="").matches(queued)
    assert RunQuery(run_id_prefix="alice:").matches(queued)
    assert not RunQuery(run_id_prefix="bob:").matches(queued)
    assert RunQuery(statuses=(RunStatus.QUEUED,)) == RunQuery(statuses={RunStatus.QUEUED})


def test_a_query_crosses_the_wire():
    query = RunQuery(
        statuses=[RunStatus.FAILED, RunStatus.QUEUED],
        target="t",
        tenant="",
        run_id_prefix="a:",
        limit=7,
    )
    assert query_from_pb(query_to_pb(query)) == query
    assert query_from_pb(query_to_pb(RunQuery())) == RunQuery()
    assert not query_to_pb(RunQuery()).HasField("tenant")
    assert query_from_pb(pb.ListRuns()).limit == 100  # 0: the node's default
