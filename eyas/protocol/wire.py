"""Converters between the protobuf messages of ``eyas.proto`` and the internal types.

Outbound (``*_to_proto``) converters trust their input: the internal frozen dataclasses are
already validated. Inbound (``*_from_proto``) converters trust nothing (docs/architecture.md,
"The wire contract"): they decode every tensor field with the codec (dtype, shape, size), rebuild the
internal dataclass (whose ``__post_init__`` checks layout and, for ``DraftTree``/``AcceptDecision``,
structure), and run ``validate_flat_tree`` on an inbound tree: parents precede children, the tree
is ancestor-closed, positions equal the base plus the depth, rows stay within the budget, token
ids lie inside the vocabulary. Each violation raises :class:`WireError` whose message starts with
the field's name, before anything reads or writes the receiver's state.

The checks that need the receiver's state (the expected round, the committed length, the frontier
token) are keyword arguments the receiver passes; the converters themselves stay pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from eyas.protocol import eyas_pb2 as pb
from eyas.protocol.checks import check_in_vocab
from eyas.protocol.codec import ANY_DIM, DEFAULT_MAX_NUMEL, decode_tensor, encode_tensor
from eyas.protocol.messages import AcceptDecision, PublishAck, Seed
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.schema import (
    DECODING_FIELDS,
    CancelRequest,
    GenerateRequest,
    parse_cancel,
    parse_request,
    request_id_problem,
)
from eyas.protocol.tree import (
    PARENT_IS_ROOT,
    ROW_IS_ROOT,
    DraftTree,
    FlatTree,
    flatten_tree,
    retrieve_from_parents,
    tree_mask_from_parents,
    validate_flat_tree,
)

NO_LIMIT = None  # a converter argument meaning "this check is not requested"


class WireError(ValueError):
    """An inbound message breaks the wire contract. The message starts with the field's name."""


@contextmanager
def _inbound() -> Iterator[None]:
    """Re-raise any ValueError (codec, dataclass, validator) as a WireError, message unchanged."""
    try:
        yield
    except WireError:
        raise
    except ValueError as err:
        raise WireError(str(err)) from None


def check_request_id(value: str, name: str = "request_id") -> str:
    """A request id, by the client edges' rule (``schema.request_id_problem``)."""
    problem = request_id_problem(value)
    if problem:
        raise WireError(f"{name}: {problem}")
    return value


def _at_least(value: int, minimum: int, name: str) -> int:
    if value < minimum:
        raise WireError(f"{name}: expected >= {minimum}, got {value}")
    return value


def _expect(value, expected, name: str, why: str) -> None:
    if expected is not NO_LIMIT and value != expected:
        raise WireError(f"{name}: {value!r} {why} (expected {expected!r})")


def _in_vocab(tokens: list[int], vocab_size: int | None, name: str) -> None:
    if vocab_size is not NO_LIMIT:
        with _inbound():
            check_in_vocab(tokens, vocab_size, name)


# --------------------------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------------------------


def flat_tree_to_proto(
    flat: FlatTree, *, request_id: str, round: int, base_position: int, include_derived: bool = False
) -> pb.FlatTree:
    """The wire form of ``flat``; ``include_derived`` also sends tree_mask and retrieve, which a
    receiver otherwise derives from parents."""
    msg = pb.FlatTree(
        request_id=request_id,
        round=round,
        base_position=base_position,
        tokens=encode_tensor(flat.tokens),
        parents=encode_tensor(flat.parents),
        depths=encode_tensor(flat.depths),
        positions=encode_tensor(flat.positions),
        draft_probs=encode_tensor(flat.draft_probs),
    )
    if include_derived:
        msg.tree_mask = encode_tensor(flat.tree_mask)
        msg.retrieve = encode_tensor(flat.retrieve)
    return msg


def draft_tree_to_proto(
    tree: DraftTree, *, frontier_token: int, request_id: str, round: int, base_position: int
) -> pb.FlatTree:
    """Flatten ``tree`` behind the frontier token (design 0x05C) into its wire form."""
    return flat_tree_to_proto(
        flatten_tree(tree, frontier_token, base_position),
        request_id=request_id,
        round=round,
        base_position=base_position,
    )


def _derived_mask_and_retrieve(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_mask [R, R] bool and retrieve [leaves, D+1] int64 from ``parents``.

    Derived only from a parents list that is rooted and precedes its children (anything else
    could index out of range or loop); otherwise an identity mask and a one-cell retrieve map
    stand in, and ``validate_flat_tree`` names the broken parents before it reads either.
    """
    r = len(parents)
    ok = r >= 1 and parents[0] == ROW_IS_ROOT and all(0 <= p < i for i, p in enumerate(parents[1:], 1))
    if not ok:
        return torch.eye(r, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.int64)
    depths = [0] * r  # from parents, not from the inbound depths (validated separately)
    for i in range(1, r):
        depths[i] = depths[parents[i]] + 1
    return (
        torch.tensor(tree_mask_from_parents(parents), dtype=torch.bool),
        torch.tensor(retrieve_from_parents(parents, depths), dtype=torch.int64),
    )


def flat_tree_from_proto(
    msg: pb.FlatTree,
    *,
    vocab_size: int,
    max_rows: int,
    base_position: int,
    round: int | None = NO_LIMIT,
    frontier_token: int | None = NO_LIMIT,
) -> FlatTree:
    """Validate an inbound FlatTree against the receiver's session; return the internal FlatTree.

    ``base_position``: the committed length (the root's position). ``round``: the round the tree
    must belong to (the last published + 1). ``frontier_token``: the token row 0 must hold.
    """
    check_request_id(msg.request_id)
    _expect(msg.round, round, "round", "is stale or from the future")
    _expect(msg.base_position, base_position, "base_position", "is not the committed length")
    with _inbound():
        tokens = decode_tensor(
            msg.tokens, name="tokens", dtype=torch.int64, shape=(ANY_DIM,), max_numel=max_rows
        )  # [R] int64; R <= max_rows (the budget)
        r = tokens.shape[0]
        if r < 1:  # before the other fields, which would be compared against zero rows
            raise WireError("tokens: a flat tree has at least the root row")

        def rows(field: str, dtype: torch.dtype) -> torch.Tensor:  # [R]
            return decode_tensor(getattr(msg, field), name=field, dtype=dtype, shape=(r,), max_numel=max_rows)

        parents = rows("parents", torch.int64)
        derived_mask, derived_retrieve = _derived_mask_and_retrieve(parents.tolist())
        flat = FlatTree(
            tokens=tokens,
            positions=rows("positions", torch.int64),
            parents=parents,
            depths=rows("depths", torch.int64),
            tree_mask=decode_tensor(
                msg.tree_mask, name="tree_mask", dtype=torch.bool, shape=(r, r), max_numel=max_rows * max_rows
            )
            if msg.HasField("tree_mask")
            else derived_mask,  # [R, R] bool
            retrieve=decode_tensor(
                msg.retrieve,
                name="retrieve",
                dtype=torch.int64,
                shape=(ANY_DIM, ANY_DIM),
                max_numel=max_rows * max_rows,
            )
            if msg.HasField("retrieve")
            else derived_retrieve,  # [leaves, D+1] int64
            draft_probs=rows("draft_probs", torch.float32),
        )
        validate_flat_tree(flat, vocab_size=vocab_size, max_rows=max_rows, base_position=base_position)
    _expect(int(flat.tokens[0]), frontier_token, "tokens", "in row 0 is not the frontier token")
    return flat


def draft_tree_from_flat(flat: FlatTree) -> DraftTree:
    """The candidate nodes of a validated FlatTree: rows 1.., the root dropped (design 0x05B/0x05C).

    The inverse of ``flatten_tree``: row ``p`` is node ``p - 1``; the root row becomes
    PARENT_IS_ROOT.
    """
    parent_rows = flat.parents[1:]  # [N] int64, every entry a row >= 0
    with _inbound():
        return DraftTree(
            tokens=flat.tokens[1:].clone(),
            parents=torch.where(parent_rows == 0, torch.full_like(parent_rows, PARENT_IS_ROOT), parent_rows - 1),
            depths=flat.depths[1:].clone(),
            draft_probs=flat.draft_probs[1:].clone(),
        )


# --------------------------------------------------------------------------------------------
# AcceptDecision
# --------------------------------------------------------------------------------------------


def decision_to_proto(decision: AcceptDecision, *, request_id: str, round: int) -> pb.AcceptDecision:
    return pb.AcceptDecision(
        request_id=request_id,
        round=round,
        accepted_rows=encode_tensor(decision.accepted_rows),
        accepted_tokens=encode_tensor(decision.accepted_tokens),
        frontier_token=decision.frontier_token,
    )


def decision_from_proto(
    msg: pb.AcceptDecision,
    *,
    request_id: str | None = NO_LIMIT,
    round: int | None = NO_LIMIT,
    vocab_size: int | None = NO_LIMIT,
    max_rows: int = DEFAULT_MAX_NUMEL,
) -> AcceptDecision:
    """Validate an inbound AcceptDecision; ``max_rows`` bounds accepted_rows (a prefill accepts
    every prompt row)."""
    check_request_id(msg.request_id)
    _expect(msg.request_id, request_id, "request_id", "is not the request asked about")
    _expect(msg.round, round, "round", "is not the round asked about")
    with _inbound():
        rows = decode_tensor(
            msg.accepted_rows, name="accepted_rows", dtype=torch.int64, shape=(ANY_DIM,), max_numel=max_rows
        )  # [A] int64
        tokens = decode_tensor(
            msg.accepted_tokens,
            name="accepted_tokens",
            dtype=torch.int64,
            shape=(max(rows.shape[0] - 1, 0),),
            max_numel=max_rows,
        )  # int64
        decision = AcceptDecision(rows, tokens, msg.frontier_token)
    _in_vocab(decision.accepted_tokens.tolist(), vocab_size, "accepted_tokens")
    _in_vocab([decision.frontier_token], vocab_size, "frontier_token")
    return decision


# --------------------------------------------------------------------------------------------
# Seed and PublishAck
# --------------------------------------------------------------------------------------------


def seed_to_proto(seed: Seed, *, request_id: str) -> pb.Seed:
    return pb.Seed(
        request_id=request_id,
        round=seed.round,
        start_position=seed.start_position,
        features=encode_tensor(seed.features),
        advanced_tokens=encode_tensor(seed.advanced_tokens),
    )


def seed_from_proto(
    msg: pb.Seed,
    *,
    feature_dim: int | None = NO_LIMIT,
    vocab_size: int | None = NO_LIMIT,
    max_rows: int = DEFAULT_MAX_NUMEL,
) -> Seed:
    """Validate an inbound Seed: features [A, feature_dim] floating, advanced_tokens [A] int64, A >= 1."""
    check_request_id(msg.request_id, "seed.request_id")
    _at_least(msg.round, 0, "seed.round")
    _at_least(msg.start_position, 0, "seed.start_position")
    with _inbound():
        tokens = decode_tensor(
            msg.advanced_tokens, name="seed.advanced_tokens", dtype=torch.int64, shape=(ANY_DIM,), max_numel=max_rows
        )  # [A] int64
        a = tokens.shape[0]
        unknown_f = feature_dim is NO_LIMIT
        features = decode_tensor(
            msg.features,
            name="seed.features",
            shape=(a, ANY_DIM if unknown_f else feature_dim),
            max_numel=DEFAULT_MAX_NUMEL if unknown_f else a * feature_dim,
        )  # [A, F]
    if a < 1:
        raise WireError("seed.advanced_tokens: a seed holds at least the frontier token")
    if not features.dtype.is_floating_point:
        raise WireError(f"seed.features: expected a floating dtype, got {features.dtype}")
    _in_vocab(tokens.tolist(), vocab_size, "seed.advanced_tokens")
    return Seed(features=features, advanced_tokens=tokens, start_position=msg.start_position, round=msg.round)


def ack_to_proto(ack: PublishAck, seed: Seed) -> pb.PublishAck:
    return pb.PublishAck(
        request_id=ack.request_id,
        round=ack.round,
        committed_len=ack.committed_len,
        output_tokens=list(ack.output_tokens),
        seed=seed_to_proto(seed, request_id=ack.request_id),
    )


def ack_from_proto(
    msg: pb.PublishAck,
    *,
    request_id: str | None = NO_LIMIT,
    round: int | None = NO_LIMIT,
    feature_dim: int | None = NO_LIMIT,
    vocab_size: int | None = NO_LIMIT,
    max_rows: int = DEFAULT_MAX_NUMEL,
) -> tuple[Seed, PublishAck]:
    """Validate an inbound PublishAck and its Seed, and that they describe the same publish."""
    check_request_id(msg.request_id)
    _expect(msg.request_id, request_id, "request_id", "is not the request published")
    _expect(msg.round, round, "round", "is not the round published")
    _at_least(msg.committed_len, 1, "committed_len")
    if not msg.output_tokens:
        raise WireError("output_tokens: a publish emits at least the frontier token")
    _in_vocab(list(msg.output_tokens), vocab_size, "output_tokens")
    if not msg.HasField("seed"):
        raise WireError("seed: missing")
    seed = seed_from_proto(msg.seed, feature_dim=feature_dim, vocab_size=vocab_size, max_rows=max_rows)
    _expect(msg.seed.request_id, msg.request_id, "seed.request_id", "is not the ack's request")
    _expect(seed.round, msg.round, "seed.round", "is not the ack's round")
    _expect(
        seed.start_position + seed.advanced_tokens.shape[0],
        msg.committed_len,
        "seed.start_position",
        "+ its rows is not the committed length",
    )
    _expect(seed.frontier_token, msg.output_tokens[-1], "seed.advanced_tokens", "ends in another frontier token")
    return seed, PublishAck(msg.request_id, msg.round, msg.committed_len, tuple(msg.output_tokens))


# --------------------------------------------------------------------------------------------
# Sessions (Verifier.OpenSession)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    """A target session's request (an ``OpenSessionRequest`` as an object): its prompt, bounds and
    sampler, by keyword. Over gRPC the sampler's fields are the message's own."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    max_tree_rows: int  # verify rows per round, the root included
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    taps: tuple[tuple[int, bool], ...] = ()  # (layers_applied, normed) per feature tap; () = none
    # each emitted token's raw log-probability with this many top alternatives (None: none). Objects
    # only: a Verifier over gRPC computes none (OpenSessionRequest has no such field)
    logprobs: int | None = None
    # the request allows its committed rows to teach the drafter where its target replica captures
    # traffic (eyas.learning; a deployment switch, off by default). Over gRPC an unset field is false
    learn: bool = True


# OpenSessionRequest's sampler fields, each SamplingParams' field of the same name (an unset one: its default)
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
)


def session_spec_to_proto(spec: SessionSpec) -> pb.OpenSessionRequest:
    sp = spec.sampling
    return pb.OpenSessionRequest(
        request_id=spec.request_id,
        prompt_ids=list(spec.prompt_ids),
        max_new_tokens=spec.max_new_tokens,
        max_tree_rows=spec.max_tree_rows,
        seed=spec.seed,
        tap_layers=[t[0] for t in spec.taps],
        tap_normed=[t[1] for t in spec.taps],
        logit_bias=dict(sp.logit_bias),
        min_tokens_stop_ids=list(sp.min_tokens_stop_ids),
        grammar=sp.grammar or None,
        learn=spec.learn,
        **{name: getattr(sp, name) for name in SAMPLING_FIELDS},
    )


def check_session_spec(spec: SessionSpec, *, vocab_size: int) -> SessionSpec:
    """The checks of an OpenSessionRequest, on a ``SessionSpec`` object (a caller in the worker's
    own process); refusals name the field as the message's would. The sampler checked itself when built."""
    check_request_id(spec.request_id)
    if not spec.prompt_ids:
        raise WireError("prompt_ids: must hold at least one token")
    _in_vocab(list(spec.prompt_ids), vocab_size, "prompt_ids")
    _at_least(spec.max_new_tokens, 1, "max_new_tokens")
    _at_least(spec.max_tree_rows, 1, "max_tree_rows")
    if any(layer < 0 for layer, _ in spec.taps):
        raise WireError(f"tap_layers: {[layer for layer, _ in spec.taps]} must be >= 0")
    _in_vocab([t for t, _ in spec.sampling.logit_bias], vocab_size, "logit_bias")
    _in_vocab(list(spec.sampling.min_tokens_stop_ids), vocab_size, "min_tokens_stop_ids")
    return spec


def session_spec_from_proto(msg: pb.OpenSessionRequest, *, vocab_size: int) -> SessionSpec:
    check_request_id(msg.request_id)
    if not msg.prompt_ids:
        raise WireError("prompt_ids: must hold at least one token")
    _in_vocab(list(msg.prompt_ids), vocab_size, "prompt_ids")
    if len(msg.tap_layers) != len(msg.tap_normed):
        raise WireError(f"tap_normed: {len(msg.tap_normed)} entries for {len(msg.tap_layers)} tap_layers")
    if any(layer < 0 for layer in msg.tap_layers):
        raise WireError(f"tap_layers: {list(msg.tap_layers)} must be >= 0")
    max_new_tokens = _at_least(msg.max_new_tokens, 1, "max_new_tokens")
    max_tree_rows = _at_least(msg.max_tree_rows, 1, "max_tree_rows")
    with _inbound():  # the sampler's own checks, named for the field
        sampling = SamplingParams(
            logit_bias=tuple(sorted(_in_vocab_bias(dict(msg.logit_bias), vocab_size).items())),
            grammar=msg.grammar,
            min_tokens_stop_ids=_ids_in_vocab(msg.min_tokens_stop_ids, vocab_size, "min_tokens_stop_ids"),
            **{name: getattr(msg, name) for name in SAMPLING_FIELDS if msg.HasField(name)},
        )
    return SessionSpec(
        request_id=msg.request_id,
        prompt_ids=tuple(msg.prompt_ids),
        max_new_tokens=max_new_tokens,
        max_tree_rows=max_tree_rows,
        sampling=sampling,
        seed=msg.seed,
        taps=tuple(zip((int(x) for x in msg.tap_layers), (bool(x) for x in msg.tap_normed))),
        learn=msg.learn if msg.HasField("learn") else False,  # a Verifier caller's session: only when it asks
    )


def _ids_in_vocab(ids, vocab_size: int, name: str) -> tuple[int, ...]:
    _in_vocab(list(ids), vocab_size, name)
    return tuple(int(t) for t in ids)


def _in_vocab_bias(bias: dict[int, float], vocab_size: int) -> dict[int, float]:
    _in_vocab(list(bias), vocab_size, "logit_bias")
    return bias


# --------------------------------------------------------------------------------------------
# The client service (Eyas.Generate)
# --------------------------------------------------------------------------------------------

_OPTIONAL_REQUEST_FIELDS = (
    "prompt",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "request_id",
    "ignore_eos",
    "min_tokens",
    *DECODING_FIELDS,
)


def generate_request_from_proto(msg: pb.GenerateRequest) -> GenerateRequest:
    """Validate through ``schema.parse_request``; an unset optional field takes the schema default."""
    fields = {name: getattr(msg, name) for name in _OPTIONAL_REQUEST_FIELDS if msg.HasField(name)}
    if msg.prompt_ids:
        fields["prompt_ids"] = list(msg.prompt_ids)
    if msg.messages:
        fields["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
    if msg.logit_bias:
        fields["logit_bias"] = dict(msg.logit_bias)
    if msg.stop_token_ids:
        fields["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("response_format"):
        try:
            fields["response_format"] = json.loads(msg.response_format)
        except json.JSONDecodeError as err:
            raise WireError(f"response_format: not valid JSON ({err.msg})") from None
    with _inbound():
        return parse_request(raw=msg.raw, stop=list(msg.stop), **fields)


def cancel_request_from_proto(msg: pb.CancelRequest) -> CancelRequest:
    """Validate a ``Cancel`` through ``schema.parse_cancel``."""
    with _inbound():
        return parse_cancel(request_id=msg.request_id)


def cancel_request_to_proto(request_id: str) -> pb.CancelRequest:
    """The wire form of a ``Cancel``, validated first (``ValueError`` naming ``request_id``)."""
    return pb.CancelRequest(request_id=parse_cancel(request_id=request_id).request_id)


def generate_request_to_proto(req: GenerateRequest) -> pb.GenerateRequest:
    """The wire form of ``req``. The ``drafter`` folder is a server-side choice, never sent."""
    if req.drafter is not None:
        raise WireError("drafter: a drafter folder is not carried over the wire")
    fields = {name: getattr(req, name) for name in _OPTIONAL_REQUEST_FIELDS if getattr(req, name) is not None}
    messages = [pb.ChatMessage(role=m.role, content=m.content) for m in req.messages or ()]
    return pb.GenerateRequest(
        raw=req.raw,
        stop=list(req.stop),
        prompt_ids=list(req.prompt_ids or ()),
        messages=messages,
        logit_bias=req.logit_bias,
        stop_token_ids=list(req.stop_token_ids),
        response_format=None if req.response_format is None else json.dumps(req.response_format),
        **fields,
    )
