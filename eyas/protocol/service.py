"""The ``eyas.v1.Eyas`` service as Ray Serve's gRPC proxy registers it: requests arrive as raw bytes.

The generated ``add_EyasServicer_to_server`` gives the proxy each request's protobuf decoder, so a
corrupt message or a string field that is not UTF-8 fails inside the proxy, before any Eyas code
runs, and the client sees ``UNKNOWN`` ("Unexpected DecodeError"). This registration names the same
methods with no request decoder: the proxy hands the ingress the bytes, and the ingress decodes
them with :func:`decode_message`, whose error names the field, so the client gets
``INVALID_ARGUMENT``. Clients are unchanged: the bytes on the wire are the same.

Name it in a Serve config's ``grpc_servicer_functions``:
``eyas.protocol.service.add_eyas_servicer_to_server``.

It also makes the proxy's ``GenerateStream`` handler cancel safely (:func:`cancel_safe_stream`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from google.protobuf import empty_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from eyas.protocol import eyas_pb2 as pb

SERVICE_NAME = "eyas.v1.Eyas"
# Request metadata: the client's time budget in milliseconds. Serve's gRPC proxy does not pass a
# call's own deadline on to the deployment, so a client that wants the server to stop working at
# its deadline says so here too (``EyasClient`` does); past it the request is cancelled within a
# round and the call ends with DEADLINE_EXCEEDED.
TIMEOUT_METADATA = "eyas-timeout-ms"
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000
SERVICER_FUNCTION = "eyas.protocol.service.add_eyas_servicer_to_server"
_WIRE_LENGTH_DELIMITED = 2  # protobuf wire type of strings, bytes and sub-messages

# method -> (unary or streaming reply, reply type); the request type is the method's own in eyas.proto
_METHODS = {
    "Generate": (grpc.unary_unary_rpc_method_handler, pb.GenerateResponse),
    "GenerateStream": (grpc.unary_stream_rpc_method_handler, pb.GenerateChunk),
    "Stats": (grpc.unary_unary_rpc_method_handler, pb.StatsResponse),
    "Cancel": (grpc.unary_unary_rpc_method_handler, pb.CancelResponse),
}


def add_eyas_servicer_to_server(servicer, server) -> None:
    """Register ``eyas.v1.Eyas`` on ``server`` with raw-bytes requests (module docstring).

    On Serve's gRPC proxy, whose server replaces every handler with one its
    ``service_handler_factory`` makes, the streaming handlers it makes for this service are
    wrapped in :func:`cancel_safe_stream` while this registration runs.
    """
    handlers = {
        name: make(getattr(servicer, name), request_deserializer=None, response_serializer=reply.SerializeToString)
        for name, (make, reply) in _METHODS.items()
    }
    factory = getattr(server, "service_handler_factory", None)  # only Serve's proxy server has one
    if callable(factory):
        server.service_handler_factory = _cancel_safe_streams(factory)
    try:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63
            server.add_registered_method_handlers(SERVICE_NAME, handlers)
    finally:
        if callable(factory):
            server.service_handler_factory = factory


def _cancel_safe_streams(factory):
    """Serve's handler factory, with this service's server-streaming handlers cancel safe."""

    def make(*, service_method: str, streaming_type, **kwargs):
        handler = factory(service_method=service_method, streaming_type=streaming_type, **kwargs)
        if service_method.startswith(f"/{SERVICE_NAME}/") and getattr(streaming_type, "name", "") == "UNARY_STREAM":
            return cancel_safe_stream(handler)
        return handler

    return make


@dataclass(frozen=True)
class _StreamFailed:
    """What ended a pumped reply stream with an exception (a queue item)."""

    error: BaseException


_STREAM_END = object()  # queue item: the reply stream ended normally


def cancel_safe_stream(stream_handler):
    """A server-streaming handler that hands a client's cancel to ``stream_handler``'s replies.

    ``stream_handler(request, context)`` is an async generator of replies, as Serve's gRPC proxy
    makes them. gRPC runs such a handler by awaiting each reply and writing it; when the client
    cancels, gRPC cancels that task wherever it waits. If it waits in the *write*, the generator
    is left suspended at its ``yield``, and Serve's proxy cancels its call to the ingress only
    when the cancel lands inside the generator's wait for the next reply. So a client that closes
    its stream just after a chunk (while the proxy writes that chunk) left its request running to
    its natural end.

    Here a second task pulls the replies into a queue. It only ever waits inside the generator
    (putting into an unbounded queue does not wait), so cancelling it lands there, which is what
    Serve's proxy needs to cancel the call. This handler writes from the queue, and whenever it
    ends before the stream has, it cancels the pulling task.
    """

    async def handler(request, context) -> None:
        replies: asyncio.Queue = asyncio.Queue()

        async def pull() -> None:
            try:
                async for reply in stream_handler(request, context):
                    replies.put_nowait(reply)
            except BaseException as error:  # noqa: BLE001 -- the writer re-raises it
                replies.put_nowait(_StreamFailed(error=error))
                raise
            replies.put_nowait(_STREAM_END)

        pulling = asyncio.ensure_future(pull())
        pulling.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved here
        try:
            while (reply := await replies.get()) is not _STREAM_END:
                if isinstance(reply, _StreamFailed):
                    raise reply.error
                await context.write(reply)
        finally:
            if not pulling.done():
                pulling.cancel()

    return handler


def decode_message(cls: type[Message], data: bytes | Message) -> Message:
    """``data`` as a ``cls`` message: raw bytes are parsed, a message of that type passes through.

    Raises ``ValueError`` naming the field: ``prompt: not valid UTF-8`` for a string field whose
    bytes are not UTF-8, else ``request: not a valid <type> protobuf message``.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"request: expected a {cls.DESCRIPTOR.full_name} message")
    data = bytes(data)
    try:
        return cls.FromString(data)
    except DecodeError:
        field = _field_with_bad_utf8(cls, data)
        if field is not None:
            raise ValueError(f"{field}: not valid UTF-8") from None
        raise ValueError(f"request: not a valid {cls.DESCRIPTOR.full_name} protobuf message") from None


def _field_with_bad_utf8(cls: type[Message], data: bytes) -> str | None:
    """The name of the first top-level string field of ``cls`` in ``data`` that is not UTF-8."""
    try:
        fields = UnknownFieldSet(empty_pb2.Empty.FromString(data))  # every field, undecoded
    except DecodeError:
        return None  # the framing itself is corrupt
    by_number = cls.DESCRIPTOR.fields_by_number
    for f in fields:
        desc = by_number.get(f.field_number)
        if desc is None or desc.type != FieldDescriptor.TYPE_STRING or f.wire_type != _WIRE_LENGTH_DELIMITED:
            continue
        try:
            bytes(f.data).decode("utf-8")
        except UnicodeDecodeError:
            return desc.name
    return None


def timeout_from_metadata(metadata) -> float | None:
    """The ``eyas-timeout-ms`` budget of a call's metadata, in seconds (None when absent).

    Raises ``ValueError`` naming ``eyas-timeout-ms`` for anything but a positive integer up to a week.
    """
    values = [v for k, v in (metadata or ()) if k == TIMEOUT_METADATA]
    if not values:
        return None
    raw = values[-1].decode() if isinstance(values[-1], bytes) else str(values[-1])
    if not raw.strip().isdigit() or not 0 < int(raw) <= MAX_TIMEOUT_MS:
        raise ValueError(
            f"{TIMEOUT_METADATA}: must be a whole number of milliseconds in 1..{MAX_TIMEOUT_MS}, got {raw[:40]!r}"
        )
    return int(raw) / 1000.0
