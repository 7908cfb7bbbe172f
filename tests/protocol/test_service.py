"""The raw-bytes registration of ``eyas.v1.Eyas`` and the ingress's decoder (eyas.protocol.service)."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import eyas_pb2_grpc
from eyas.protocol.service import add_eyas_servicer_to_server, decode_message


def test_a_valid_message_decodes_and_an_object_passes_through():
    msg = pb.GenerateRequest(prompt="héllo", max_new_tokens=5, stop=["x"])
    assert decode_message(pb.GenerateRequest, msg.SerializeToString()) == msg
    assert decode_message(pb.GenerateRequest, msg) is msg


@pytest.mark.parametrize("field", ["prompt", "request_id", "method", "stop"])
def test_a_string_field_that_is_not_utf8_is_named(field):
    value = ["zz"] if field == "stop" else "zz"
    data = pb.GenerateRequest(max_new_tokens=3, **{field: value}).SerializeToString().replace(b"zz", b"\xc3\x28")
    with pytest.raises(ValueError, match=f"^{field}: not valid UTF-8$"):
        decode_message(pb.GenerateRequest, data)


@pytest.mark.parametrize("data", [b"\x0a\xff", b"\xff" * 9, pb.GenerateRequest(prompt="abc").SerializeToString()[:-1],
                                  bytes([0x0A, 0x80, 0x80, 0x80, 0x80, 0x10])])
def test_corrupt_framing_is_a_request_error(data):
    with pytest.raises(ValueError, match=r"^request: not a valid eyas\.v1\.GenerateRequest protobuf message$"):
        decode_message(pb.GenerateRequest, data)


def test_a_wrong_type_is_refused():
    with pytest.raises(ValueError, match="^request: expected a eyas.v1.CancelRequest message$"):
        decode_message(pb.CancelRequest, pb.StatsRequest())


class _Echo:
    """Answers with the Python type the handler was given (the bytes a client sent, undecoded)."""
    def Generate(self, request, context):
        return pb.GenerateResponse(text=type(request).__name__, token_ids=list(request[:4]))

    def GenerateStream(self, request, context):
        yield pb.GenerateChunk(text=type(request).__name__)

    def Stats(self, request, context):
        return pb.StatsResponse(json=type(request).__name__)

    def Cancel(self, request, context):
        return pb.CancelResponse()


def test_the_registration_hands_the_servicer_raw_bytes_and_the_generated_stub_still_works():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_eyas_servicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = eyas_pb2_grpc.EyasStub(channel)
            request = pb.GenerateRequest(prompt="hi")
            reply = stub.Generate(request, timeout=10)
            assert reply.text == "bytes" and bytes(reply.token_ids) == request.SerializeToString()[:4]
            assert [c.text for c in stub.GenerateStream(request, timeout=10)] == ["bytes"]
            assert stub.Stats(pb.StatsRequest(), timeout=10).json == "bytes"
            stub.Cancel(pb.CancelRequest(request_id="r"), timeout=10)
    finally:
        server.stop(0)


def test_the_timeout_metadata_is_milliseconds_and_anything_else_is_named():
    from eyas.protocol.service import MAX_TIMEOUT_MS, TIMEOUT_METADATA, timeout_from_metadata

    assert timeout_from_metadata(()) is None and timeout_from_metadata(None) is None
    assert timeout_from_metadata((("application", "eyas"), (TIMEOUT_METADATA, "1500"))) == 1.5
    assert timeout_from_metadata(((TIMEOUT_METADATA, b"20"),)) == 0.02
    for bad in ("", "0", "-1", "1.5", "1e3", "soon", str(MAX_TIMEOUT_MS + 1)):
        with pytest.raises(ValueError, match=f"^{TIMEOUT_METADATA}: "):
            timeout_from_metadata(((TIMEOUT_METADATA, bad),))
