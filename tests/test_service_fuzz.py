"""Structured fuzz of every unary RPC against a real server: hypothesis builds each request message from
its protobuf descriptor (malformed packed bytes, huge repeated fields, foreign and stale handles, bogus
sessions). No call may end in INTERNAL or UNKNOWN (a bug, not bad input), a refused call must change
nothing, and the server's own checker is clean at the end."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixd.client import CacheClient
from radixd.proto import cache_pb2 as pb
from radixd.proto import cache_pb2_grpc as pb_grpc

from .conftest import ServerProc

SERVICE = pb.DESCRIPTOR.services_by_name["RadixCache"]
UNARY = [m for m in SERVICE.methods if not m.server_streaming and m.name != "Reset"]
STATE = ("free_tokens", "cached_tokens", "evictable_tokens", "protected_tokens", "held_tokens", "in_flight_tokens",
         "num_nodes", "receipts", "sessions")
CAPACITY = 2048


@pytest.fixture(scope="module")
def world():
    srv = ServerProc("--num-slots", str(CAPACITY), "--page-size", "4", "--kv-events")
    c = CacheClient(srv.target, name="fuzz")
    ids = []
    for base in (100, 200, 300):  # some real state, so handles and receipts in the fuzz can be live ones
        toks = np.arange(base, base + 40, dtype=np.int32)
        ins = c.insert(toks, c.alloc(40))
        m = c.match_prefix(toks, lock=True)
        ids += [ins.node_id, m.node_id, m.receipt_id]
    channel = grpc.insecure_channel(srv.target, options=[("grpc.max_send_message_length", 64 << 20),
                                                         ("grpc.max_receive_message_length", 64 << 20)])
    yield srv, c, pb_grpc.RadixCacheStub(channel), ids
    channel.close()
    c.close()
    srv.stop()


def _packed(dtype: str, lo: int, hi: int):
    return st.lists(st.integers(lo, hi), max_size=64).map(lambda xs: np.asarray(xs, dtype=dtype).tobytes())


def _scalar(f, live: dict):
    t = f.type
    if t == F.TYPE_BYTES:
        return st.one_of(_packed("<i4", -5, 600), _packed("<i8", -3, CAPACITY + 5), st.binary(max_size=37),
                         st.just(b"\x01" * (1 << 20)))  # unaligned, negative, out of range, a megabyte
    if t == F.TYPE_STRING and f.name == "session_id":  # mostly the live session, so calls get past it
        return st.one_of(st.just(live["sid"]), st.just(live["sid"]), st.just(live["sid"]),
                         st.sampled_from(["", "bogus-session"]))
    if t == F.TYPE_STRING:
        return st.one_of(st.just(""), st.text(max_size=12))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.one_of(st.sampled_from(live["ids"]), st.integers(0, 2**64 - 1), st.integers(0, 64))
    if t in (F.TYPE_INT64, F.TYPE_SFIXED64, F.TYPE_SINT64):
        return st.integers(-2**63, 2**63 - 1)
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 64), st.integers(0, 5000))
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(-2**31, 2**31 - 1)
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(allow_nan=False, width=32)
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    raise AssertionError(f"no strategy for field {f.full_name}")


def _message(desc, live: dict, depth: int = 0):
    """A strategy for any message of this type: each field set or not, repeated fields short or huge."""
    fields = {}
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            one = _message(f.message_type, live, depth + 1) if depth < 3 else st.just(None)
        else:
            one = _scalar(f, live)
        if f.is_repeated:
            size = st.one_of(st.integers(0, 4), st.just(5000)) if f.type != F.TYPE_MESSAGE else st.integers(0, 3)
            fields[f.name] = size.flatmap(lambda n, one=one: st.lists(one, min_size=n, max_size=n))
        else:
            fields[f.name] = st.one_of(st.none(), one)

    def build(values):
        msg = desc._concrete_class()
        for name, v in values.items():
            if v is None:
                continue
            f = desc.fields_by_name[name]
            if f.is_repeated:
                if f.type == F.TYPE_MESSAGE:
                    getattr(msg, name).extend([x for x in v if x is not None])
                else:
                    getattr(msg, name).extend(v)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg
    return st.fixed_dictionaries(fields).map(build)


def _state(c: CacheClient) -> dict:
    s = c.stats()
    return {k: s[k] for k in STATE}


OUTCOMES: dict[tuple[str, str], int] = {}


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # megabyte fields have huge reprs
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_request_is_a_server_bug_and_refusals_change_nothing(world, data):
    srv, c, stub, ids = world
    live = {"sid": c.session_id, "ids": ids}
    method = data.draw(st.sampled_from(UNARY))
    request = data.draw(_message(method.input_type, live))
    before = _state(c)
    try:
        getattr(stub, method.name)(request, timeout=30)
        ok, code = True, grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED), (method.name, code, e.details())
        assert e.details(), (method.name, code, "a refusal says why")
        ok = False
    OUTCOMES[(method.name, code.name)] = OUTCOMES.get((method.name, code.name), 0) + 1
    if not ok:
        assert _state(c) == before, (method.name, "a refused request changed the state")
    s = c.stats()
    assert s["free_tokens"] + s["cached_tokens"] + s["held_tokens"] + s["in_flight_tokens"] == CAPACITY


def test_the_fuzzed_server_is_still_consistent(world):
    srv, c, stub, ids = world
    assert c.check() == []
    assert srv.proc.poll() is None
    methods = {m for m, _ in OUTCOMES}
    assert len(methods) >= len(UNARY) - 2, sorted(OUTCOMES)  # the fuzz reached (nearly) every RPC
    assert any(code == "OK" for _, code in OUTCOMES) and any(code != "OK" for _, code in OUTCOMES)


def test_oversized_requests_are_refused_before_anything_is_allocated(world):
    srv, c, stub, ids = world
    before = _state(c)
    with pytest.raises(grpc.RpcError) as e:  # beyond the server's message limit (64 MiB here)
        stub.Echo(pb.EchoRequest(payload=b"x" * (65 << 20)), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    limit = c.info()["max_batch_tokens"]
    with pytest.raises(grpc.RpcError) as e:  # more slots than one batch may ask for
        stub.Alloc(pb.AllocRequest(session_id=c.session_id, num_tokens=[limit // 2, limit // 2 + 4]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(limit) in e.value.details()
    assert _state(c) == before


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=41), _packed("<i4", -2**31, 2**31 - 1), _packed("<i4", 0, 2**31 - 1)))
def test_match_keys_are_refused_exactly_when_decoded_tokens_are(raw):
    """MatchPrefix keys the tree on the request's bytes (token_key); it must refuse what decode_tokens refuses,
    with the same message, and pass everything else through untouched."""
    from radixd.server.core import decode_tokens, token_key
    from radixd.server.errors import BadRequest
    try:
        want = decode_tokens(raw, "item 0 tokens").tobytes()
    except BadRequest as e:
        with pytest.raises(BadRequest) as got:
            token_key(raw, 0)
        assert str(got.value) == str(e)
    else:
        assert token_key(raw, 0) == want
