"""``EyasClient``: a small Python client for the ``Eyas`` gRPC service (Ray Serve's gRPC proxy).

    with EyasClient("127.0.0.1:9000") as client:
        report = client.generate(prompt="Name three planets.", max_new_tokens=64)   # the --json report
        for chunk in client.stream(prompt="Count to ten.", method="eagle3"):         # one chunk per round
            print(chunk.text, end="", flush=True)
        print(client.stats()["metrics"]["eyas.accept_length"])

Requests are validated here first (``eyas.protocol.schema``), so a bad field fails before the
network with the same ``ValueError("<field>: <why>")`` the server would send as INVALID_ARGUMENT.
A server refusal raises :class:`ServerRejected` (a ``ValueError``) with the server's message.
Closing a stream early (``break``, or ``close()`` on the iterator) cancels the request: the client
cancels the call *and* sends ``Cancel`` for the request's name (every streamed request is named; a
bare call-cancel can be lost in Ray Serve 2.60's gRPC proxy). The server stops the request at its
next round and frees its sessions. ``cancel(request_id)`` stops any named request.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator

import grpc

from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import eyas_pb2_grpc, wire
from eyas.protocol.schema import parse_request
from eyas.protocol.service import TIMEOUT_METADATA

log = logging.getLogger("eyas.client")
APPLICATION_METADATA = "application"  # Serve's gRPC proxy routes by this key when it hosts several apps


class ServerRejected(ValueError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


class EyasClient:
    def __init__(
        self,
        address: str = "127.0.0.1:9000",
        *,
        application: str | None = "eyas",
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        """``api_key``: sent as ``authorization: Bearer <key>`` metadata (a server started with a key
        answers UNAUTHENTICATED without it)."""
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = eyas_pb2_grpc.EyasStub(self.channel)
        self.metadata = (((APPLICATION_METADATA, application),) if application else ()) + (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EyasClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(**fields) -> pb.GenerateRequest:
        return wire.generate_request_to_proto(parse_request(**fields))

    def generate(self, **fields) -> dict:
        """The report ``eyas generate --json`` prints, for the fields of ``GenerateRequest``."""
        reply = self._call(self.stub.Generate, self.request(**fields))
        return json.loads(reply.report_json)

    def stream(self, **fields) -> Iterator[pb.GenerateChunk]:
        """One chunk per round. The request is named (``request_id``, a fresh one unless given), so
        that stopping early can cancel it by name as well as by closing the call. Each token arrives
        once: a chunk whose tokens were all received already (``first_token_index``) is dropped."""
        if not fields.get("request_id"):
            fields["request_id"] = uuid.uuid4().hex
        call = self.stub.GenerateStream(self.request(**fields), timeout=self.timeout_s, metadata=self._timed())
        ended, received = False, 0
        try:
            for chunk in call:
                ended = bool(chunk.finish_reason)
                if chunk.token_ids and chunk.first_token_index + len(chunk.token_ids) <= received:
                    continue  # a chunk this client has already
                received = max(received, chunk.first_token_index + len(chunk.token_ids))
                yield chunk
        except grpc.RpcError as err:
            ended = True
            raise self._mapped(err) from None
        finally:
            call.cancel()  # a no-op once the stream ended; cancels the request when the caller stops early
            if not ended:
                try:
                    self.cancel(fields["request_id"])
                except Exception as err:  # noqa: BLE001 - logged; best effort: the call's own cancel went out already
                    log.warning("Cancel(%s) failed: %s", fields["request_id"], err)

    def cancel(self, request_id: str) -> None:
        """Stop the named in-flight request wherever it runs (a no-op for an unknown or finished one)."""
        self._call(self.stub.Cancel, wire.cancel_request_to_proto(request_id))

    def stats(self) -> dict:
        return json.loads(self._call(self.stub.Stats, pb.StatsRequest()).json)

    def finish_counts(self) -> dict[str, float]:
        """Requests finished so far, per finish reason ("stop", "length", "cancelled", "error"), over
        every target replica (the ``eyas.requests`` metric of ``Stats``)."""
        counts: dict[str, float] = {}
        for point in self.stats()["metrics"].get("eyas.requests", []):
            reason = point["attributes"]["finish_reason"]
            counts[reason] = counts.get(reason, 0) + point["value"]
        return counts

    def idle(self) -> bool:
        """Whether no worker of the app holds a session or an in-flight request (a drain check)."""
        return all(w["live_sessions"] == 0 and w["live_requests"] == 0 for w in self.stats()["workers"])

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s, metadata=self._timed())
        except grpc.RpcError as err:
            raise self._mapped(err) from None

    def _timed(self) -> tuple:
        """The metadata with the call's time budget, so that the server stops at the deadline as well
        (Serve's proxy does not pass a gRPC deadline on)."""
        return self.metadata + ((TIMEOUT_METADATA, str(max(1, int(1000 * self.timeout_s)))),)

    @staticmethod
    def _mapped(err: grpc.RpcError) -> Exception:
        if err.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ):
            return ServerRejected(err.code(), err.details())
        return err
