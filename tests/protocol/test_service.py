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


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\xff",
        b"\xff" * 9,
        pb.GenerateRequest(prompt="abc").SerializeToString()[:-1],
        bytes([0x0A, 0x80, 0x80, 0x80, 0x80, 0x10]),
    ],
)
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


class _ProxyStream:
    """A reply stream shaped like Serve's proxy handler: it waits for each reply from the ingress and
    records whether a cancel landed in that wait (the only place where the proxy cancels its call)."""

    def __init__(self, num_replies: int):
        self.num_replies = num_replies
        self.cancelled_in_wait = False
        self.next_reply = None  # asyncio.Event, made on the loop

    async def __call__(self, request, context):
        import asyncio

        for i in range(self.num_replies):
            self.next_reply = asyncio.Event()
            asyncio.get_running_loop().call_later(0.01, self.next_reply.set)
            try:
                await self.next_reply.wait()
            except asyncio.CancelledError:
                self.cancelled_in_wait = True
                raise
            yield b"chunk %d" % i


class _StuckWriteContext:
    """A servicer context whose second write never finishes: the client leaves during it."""

    def __init__(self):
        import asyncio

        self.written = []
        self.in_second_write = asyncio.Event()

    async def write(self, reply):
        import asyncio

        self.written.append(reply)
        if len(self.written) == 2:
            self.in_second_write.set()
            await asyncio.Event().wait()


async def _leave_during_the_second_write(handler, stream):
    import asyncio

    context = _StuckWriteContext()
    task = asyncio.ensure_future(handler(b"", context))
    await asyncio.wait_for(context.in_second_write.wait(), 10)
    task.cancel()  # what grpc does when the client cancels
    await asyncio.wait([task], timeout=10)
    for _ in range(10):
        await asyncio.sleep(0)  # let the cancelled tasks unwind
    return context


def test_a_cancel_during_a_write_reaches_the_reply_stream_through_the_cancel_safe_handler():
    """The race that left a closed stream's request running: the client cancels while a chunk is
    being written. grpc's own loop (await a reply, write it) leaves the proxy's stream suspended at
    its yield, so its wait never sees the cancel; the cancel-safe handler's puller is waiting
    there, and the cancel lands in it."""
    import asyncio

    from eyas.protocol.service import cancel_safe_stream

    async def grpc_style(request, context, stream):
        async for reply in stream(request, context):
            await context.write(reply)

    naive = _ProxyStream(num_replies=50)
    context = asyncio.run(_leave_during_the_second_write(lambda r, c: grpc_style(r, c, naive), naive))
    assert context.written == [b"chunk 0", b"chunk 1"] and not naive.cancelled_in_wait

    safe = _ProxyStream(num_replies=50)
    context = asyncio.run(_leave_during_the_second_write(cancel_safe_stream(safe), safe))
    assert context.written[:2] == [b"chunk 0", b"chunk 1"] and safe.cancelled_in_wait


def test_the_cancel_safe_handler_writes_every_reply_in_order_and_passes_an_error_on():
    import asyncio

    from eyas.protocol.service import cancel_safe_stream

    class Context:
        def __init__(self):
            self.written = []

        async def write(self, reply):
            self.written.append(reply)

    context = Context()
    asyncio.run(cancel_safe_stream(_ProxyStream(num_replies=5))(b"", context))
    assert context.written == [b"chunk %d" % i for i in range(5)]

    async def failing(request, context):
        yield b"first"
        raise RuntimeError("the stream broke")

    context = Context()
    with pytest.raises(RuntimeError, match="the stream broke"):
        asyncio.run(cancel_safe_stream(failing)(b"", context))
    assert context.written == [b"first"]


def test_on_serves_proxy_server_only_the_streaming_handler_is_wrapped_and_the_factory_restored():
    """Registered on Serve's own gRPC server class: GenerateStream runs through the cancel-safe
    handler, the unary methods are the factory's, and the server's factory is left as it was; over
    a real channel the stream's replies arrive in order."""
    import asyncio

    from grpc import aio
    from ray.serve._private.grpc_util import gRPCGenericServer

    made = {}

    def factory(*, service_method, streaming_type):
        async def unary(request, context):
            return pb.GenerateResponse(text=service_method).SerializeToString()

        async def stream(request, context):
            for i in range(3):
                yield pb.GenerateChunk(text=f"{service_method} {i}").SerializeToString()

        handler = stream if streaming_type.name == "UNARY_STREAM" else unary
        made.setdefault((service_method, streaming_type.name), []).append(handler)
        return handler

    async def run():
        server = gRPCGenericServer(factory)
        add_eyas_servicer_to_server(_Echo(), server)
        assert server.service_handler_factory is factory
        handlers = server.generic_rpc_handlers[0][0]._method_handlers
        stream_handler = handlers["/eyas.v1.Eyas/GenerateStream"].unary_stream
        assert stream_handler not in made[("/eyas.v1.Eyas/GenerateStream", "UNARY_STREAM")]
        assert stream_handler.__qualname__.startswith("cancel_safe_stream")
        assert handlers["/eyas.v1.Eyas/Generate"].unary_unary in made[("/eyas.v1.Eyas/Generate", "UNARY_UNARY")]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = eyas_pb2_grpc.EyasStub(channel)
                chunks = [c.text async for c in stub.GenerateStream(pb.GenerateRequest(prompt="hi"), timeout=10)]
                reply = await stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=10)
        finally:
            await server.stop(0)
        return chunks, reply.text

    chunks, text = asyncio.run(run())
    assert chunks == [f"/eyas.v1.Eyas/GenerateStream {i}" for i in range(3)]
    assert text == "/eyas.v1.Eyas/Generate"
