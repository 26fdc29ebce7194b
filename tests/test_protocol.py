"""The sans-IO protocol core, without sockets."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop_trio.protocol import (
    PeerError,
    ProtocolError,
    ProtoConnection,
    Reply,
    Request,
    Role,
    StaleReply,
    decode,
    pb,
)
from iop_trio.protocol.convert import (
    dict_from_struct,
    event_from_pb,
    event_to_pb,
    merge_deltas,
    request_from_spec,
    spec_from_request,
    summary_from_record,
    usage_from_pb,
    usage_to_pb,
)
from iop_trio.runtime import (
    EventKind,
    InvalidRequest,
    RunEvent,
    RunRecord,
    RunSpec,
    RunStatus,
    Usage,
)


def envelope(**fields: object) -> bytes:
    return pb.Envelope(**fields).SerializeToString()  # type: ignore[arg-type]


def pair() -> tuple[ProtoConnection, ProtoConnection]:
    return ProtoConnection(Role.EDGE), ProtoConnection(Role.RUNNER)


def test_nonces_are_unique_and_nonzero():
    edge, _ = pair()
    nonces = [edge.request("ping", pb.Ping())[0] for _ in range(100)]
    assert len(set(nonces)) == 100
    assert 0 not in nonces
    assert edge.pending == 100


def test_nonce_wraps_and_skips_pending():
    edge, _ = pair()
    edge._next_nonce = 2**64 - 1
    first, _ = edge.request("ping", pb.Ping())
    second, _ = edge.request("ping", pb.Ping())
    assert (first, second) == (2**64 - 1, 1)
    edge._next_nonce = 2**64 - 1  # that one is still pending: skipped
    assert edge.request("ping", pb.Ping())[0] == 2


def test_request_reply_round_trip():
    edge, node = pair()
    nonce, frame = edge.request("cancel_run", pb.CancelRun(run_id="r1"))
    incoming = node.receive(frame)
    assert incoming == Request(nonce, "cancel_run", pb.CancelRun(run_id="r1"))
    answer = node.reply(nonce, "cancel_result", pb.CancelResult(run_id="r1", cancelled=True))
    reply = edge.receive(answer)
    assert isinstance(reply, Reply)
    assert (reply.reply_to, reply.kind, reply.final) == (nonce, "cancel_result", True)
    assert edge.pending == 0


def test_many_calls_in_flight_are_matched_by_nonce():
    edge, node = pair()
    sent = [edge.request("get_run", pb.GetRun(run_id=f"r{i}")) for i in range(5)]
    # answered in reverse order
    for nonce, frame in reversed(sent):
        request = node.receive(frame)
        assert isinstance(request, Request)
        info = pb.RunInfo(run=pb.RunSummary(run_id=request.message.run_id))  # type: ignore[attr-defined]
        reply = edge.receive(node.reply(nonce, "run_info", info))
        assert isinstance(reply, Reply)
        assert reply.message.run.run_id == f"r{sent.index((nonce, frame))}"  # type: ignore[attr-defined]
    assert edge.pending == 0


def test_run_request_streams_until_the_terminal_event():
    edge, node = pair()
    nonce, frame = edge.request("run_request", pb.RunRequest(target="t", prompt="p"))
    node.receive(frame)
    accepted = edge.receive(node.reply(nonce, "run_accepted", pb.RunAccepted(run_id="r")))
    assert isinstance(accepted, Reply) and not accepted.final
    delta = pb.RunEvent(run_id="r", seq=3, kind=pb.EVENT_KIND_DELTA, text="x")
    assert edge.receive(node.reply(nonce, "run_event", delta)).final is False  # type: ignore[union-attr]
    done = pb.RunEvent(run_id="r", seq=4, kind=pb.EVENT_KIND_SUCCEEDED)
    assert edge.receive(node.reply(nonce, "run_event", done)).final is True  # type: ignore[union-attr]
    # anything after the end is stale, not an error
    late = edge.receive(node.reply(nonce, "run_event", delta))
    assert late == StaleReply(nonce, "run_event")


def test_follow_of_an_ended_run_is_one_reply():
    edge, node = pair()
    nonce, _ = edge.request("get_run", pb.GetRun(run_id="r", follow=True))
    info = pb.RunInfo(run=pb.RunSummary(run_id="r", status=pb.RUN_STATUS_SUCCEEDED))
    assert edge.receive(node.reply(nonce, "run_info", info)).final is True  # type: ignore[union-attr]
    nonce, _ = edge.request("get_run", pb.GetRun(run_id="r", follow=True))
    info.run.status = pb.RUN_STATUS_RUNNING
    assert edge.receive(node.reply(nonce, "run_info", info)).final is False  # type: ignore[union-attr]


def test_an_error_ends_any_exchange():
    edge, node = pair()
    nonce, _ = edge.request("run_request", pb.RunRequest(target="t", prompt="p"))
    reply = edge.receive(node.error(nonce, pb.ERROR_CODE_UNKNOWN_TARGET, "no such target"))
    assert isinstance(reply, Reply)
    assert (reply.kind, reply.final) == ("error", True)
    assert edge.pending == 0


def test_a_wrong_answer_breaks_only_that_exchange():
    edge, node = pair()
    nonce, _ = edge.request("cancel_run", pb.CancelRun(run_id="r"))
    other, _ = edge.request("ping", pb.Ping())
    with pytest.raises(ProtocolError) as caught:
        edge.receive(node.reply(nonce, "run_list", pb.RunList()))
    assert (caught.value.code, caught.value.broken) == (pb.ERROR_CODE_UNEXPECTED, nonce)
    assert edge.pending == 1  # the ping still waits
    assert edge.receive(node.reply(other, "pong", pb.Pong())).final is True  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("frame", "code", "text"),
    [
        (b"\xff\xff\xff", pb.ERROR_CODE_MALFORMED, "undecodable"),
        (b"", pb.ERROR_CODE_MALFORMED, "without a known body"),
        ("text", pb.ERROR_CODE_MALFORMED, "text frame"),
        (envelope(nonce=7, hello=pb.Hello(node_id="x")), pb.ERROR_CODE_UNEXPECTED, "not a request"),
        (envelope(ping=pb.Ping()), pb.ERROR_CODE_MALFORMED, "without a nonce"),
    ],
)
def test_bad_frames_raise_protocol_errors(frame, code, text):
    node = ProtoConnection(Role.RUNNER)
    with pytest.raises(ProtocolError, match=text) as caught:
        node.receive(frame)
    assert caught.value.code == code


def test_an_unattributed_error_is_reported_not_answered():
    edge, node = pair()
    garbage_error = node.error(0, pb.ERROR_CODE_MALFORMED, "undecodable envelope")
    incoming = edge.receive(garbage_error)
    assert incoming == PeerError(pb.ERROR_CODE_MALFORMED, "undecodable envelope")


def test_the_offending_nonce_is_answered():
    node = ProtoConnection(Role.RUNNER)
    with pytest.raises(ProtocolError) as caught:
        node.receive(envelope(nonce=42, hello=pb.Hello()))
    assert caught.value.reply_to == 42
    error = decode(node.error(42, caught.value.code, caught.value.message))
    assert (error.reply_to, error.WhichOneof("body")) == (42, "error")


@settings(max_examples=500)
@given(st.binary(max_size=256))
def test_any_bytes_either_parse_or_raise_protocol_error(data):
    for role in Role:
        conn = ProtoConnection(role)
        with contextlib.suppress(ProtocolError):
            conn.receive(data)


def test_run_event_conversion_round_trips():
    event = RunEvent("r", 9, EventKind.SUCCEEDED, 12.5, reason="", usage=Usage("stop", 3, 7))
    assert event_from_pb(event_to_pb(event)) == event
    delta = RunEvent("r", 4, EventKind.DELTA, 1.0, text="héllo", tokens=2)
    assert event_from_pb(event_to_pb(delta)) == delta


@pytest.mark.parametrize(
    "usage",
    [
        Usage("stop", 3, 7),
        Usage("", 0, 0, prompt_estimated=True, completion_estimated=True),  # 0 is not None
        Usage("stop", 5, 2, completion_estimated=True),
        Usage("length"),  # an engine that reported no counts
    ],
)
def test_a_usage_and_what_in_it_is_estimated_cross_the_wire(usage):
    event = RunEvent("r", 9, EventKind.CANCELLED, 12.5, usage=usage)
    assert event_from_pb(event_to_pb(event)).usage == usage
    record = RunRecord("r", "echo/m", RunStatus.CANCELLED, False, 1.0, usage=usage)
    assert usage_from_pb(summary_from_record(record).usage) == usage


def test_an_older_peers_usage_reads_as_it_meant_it():
    """An older peer sends a count of 0 for none (it leaves the field out) and says
    nothing of estimates; a newer one sends a 0 it means, which an older one reads as none."""
    # what an older peer sends for done_reason "stop", prompt_tokens 0, completion_tokens 4:
    # field 1 (a string) and field 3 (a varint); proto3 does not send a plain field's 0
    old = b"\x0a\x04stop\x18\x04"
    assert usage_from_pb(pb.Usage.FromString(old)) == Usage("stop", None, 4)
    sent = usage_to_pb(Usage("", 0, 4, prompt_estimated=True)).SerializeToString()
    assert b"\x10\x00" in sent  # field 2, 0: sent, since it is meant
    assert not summary_from_record(RunRecord("r", "t", RunStatus.QUEUED, False, 1.0)).HasField(
        "usage"
    )


def test_run_spec_round_trips_through_the_wire():
    spec = RunSpec(
        "echo/m",
        "",
        messages=(("system", "be brief"), ("user", "hi")),
        background=True,
        run_id="job-1",
        options={"temperature": 0.5, "num_predict": 10, "stop": ["\n"], "nested": {"a": True}},
    )
    assert spec_from_request(request_from_spec(spec)) == spec


@pytest.mark.parametrize(
    ("request_", "text"),
    [
        (pb.RunRequest(prompt="p"), "without a target"),
        (pb.RunRequest(target="t"), "neither a prompt nor messages"),
        (
            pb.RunRequest(target="t", messages=[pb.ChatMessage(role="wizard", content="x")]),
            "messages\\[0\\].role 'wizard'",
        ),
    ],
)
def test_bad_run_requests_say_what_is_wrong(request_, text):
    with pytest.raises(InvalidRequest, match=text):
        spec_from_request(request_)


def test_struct_numbers_come_back_as_ints_where_whole():
    from iop_trio.protocol.convert import struct_from_dict

    assert dict_from_struct(struct_from_dict({"n": 3, "x": 0.25})) == {"n": 3, "x": 0.25}


_KINDS = [EventKind.DELTA, EventKind.DELTA, EventKind.DELTA, EventKind.STARTED]


@settings(max_examples=200)
@given(
    pieces=st.lists(
        st.tuples(st.sampled_from(["r1", "r2"]), st.sampled_from(_KINDS), st.text(max_size=5)),
        max_size=30,
    ),
    max_text=st.integers(min_value=1, max_value=12),
)
def test_merged_deltas_keep_the_text_its_order_and_every_status_event(pieces, max_text):
    events = [
        event_to_pb(
            RunEvent(run, seq, kind, float(seq), text=text if kind is EventKind.DELTA else "")
        )
        for seq, (run, kind, text) in enumerate(pieces, start=1)
    ]
    for event in events:
        if event.kind == pb.EVENT_KIND_DELTA:
            event.tokens = len(event.text)  # a token a character, say
    originals = [(e.run_id, e.seq, e.kind, e.text) for e in events]
    merged = merge_deltas(events, max_text=max_text)
    # per run, the same text in the same order, and the same status events in place
    for run in ("r1", "r2"):
        assert "".join(e.text for e in merged if e.run_id == run) == "".join(
            text for r, _, kind, text in originals if r == run
        )
    # a merged delta holds the engine tokens of its pieces
    assert all(e.tokens == len(e.text) for e in merged)
    statuses = [(r, q) for r, q, kind, _ in originals if kind != pb.EVENT_KIND_DELTA]
    assert [(e.run_id, e.seq) for e in merged if e.kind != pb.EVENT_KIND_DELTA] == statuses
    # a merged delta has the seq (and time) of its last piece; seqs only grow
    seqs = [e.seq for e in merged]
    assert seqs == sorted(seqs) and set(seqs) <= {q for _, q, _, _ in originals}
    assert all(e.time == float(e.seq) for e in merged)
    # only neighbours of one run merge, within max_text (one longer piece stays whole)
    for before, after in itertools.pairwise(merged):
        if before.kind == after.kind == pb.EVENT_KIND_DELTA and before.run_id == after.run_id:
            assert len(before.text) + len(after.text) > max_text
    assert len(merged) <= len(events)
