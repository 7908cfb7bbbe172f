"""The ``eyas.v1.Eyas`` service as Ray Serve's gRPC proxy registers it: requests arrive as raw bytes.

The generated ``add_EyasServicer_to_server`` gives the proxy each request's protobuf decoder, so a
corrupt message or a string field that is not UTF-8 fails inside the proxy, before any Eyas code
runs, and the client sees ``UNKNOWN`` ("Unexpected DecodeError"). This registration names the same
methods with no request decoder: the proxy hands the ingress the bytes, and the ingress decodes
them with :func:`decode_message`, whose error names the field, so the client gets
``INVALID_ARGUMENT``. Clients are unchanged: the bytes on the wire are the same.

Name it in a Serve config's ``grpc_servicer_functions``:
``eyas.protocol.service.add_eyas_servicer_to_server``.
"""
from __future__ import annotations

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
_WIRE_LENGTH_DELIMITED = 2   # protobuf wire type of strings, bytes and sub-messages

# method -> (unary or streaming reply, reply type); the request type is the method's own in eyas.proto
_METHODS = {"Generate": (grpc.unary_unary_rpc_method_handler, pb.GenerateResponse),
            "GenerateStream": (grpc.unary_stream_rpc_method_handler, pb.GenerateChunk),
            "Stats": (grpc.unary_unary_rpc_method_handler, pb.StatsResponse),
            "Cancel": (grpc.unary_unary_rpc_method_handler, pb.CancelResponse)}


def add_eyas_servicer_to_server(servicer, server) -> None:
    """Register ``eyas.v1.Eyas`` on ``server`` with raw-bytes requests (module docstring)."""
    handlers = {name: make(getattr(servicer, name), request_deserializer=None,
                           response_serializer=reply.SerializeToString)
                for name, (make, reply) in _METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):   # grpcio >= 1.63
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


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
        fields = UnknownFieldSet(empty_pb2.Empty.FromString(data))   # every field, undecoded
    except DecodeError:
        return None   # the framing itself is corrupt
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
        raise ValueError(f"{TIMEOUT_METADATA}: must be a whole number of milliseconds in 1..{MAX_TIMEOUT_MS}, "
                         f"got {raw[:40]!r}")
    return int(raw) / 1000.0
