"""The serving application's configuration (``args:`` in ray_configs/serve.yaml): a pydantic model,
read by the ingress (``eyas.serve.app``) and by each deployment (``eyas.serve.deployments``);
errors name the field (``config.<field>: ...``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray.serve.config import AutoscalingConfig

from eyas.scheduler.cost import DEFAULT_PREFILL_CHUNK
from eyas.target.loader import CPU_KERNELS, DEFAULT_TARGET, PRECISIONS, check_device, check_dtype

REPLICA_KINDS = ("target", "drafter")


class LearnSettings(BaseModel):
    """Online learning (``eyas.learning``): the target replicas capture what their learning sessions
    commit, a learner actor (nice 19, one thread) trains a copy of ``method``'s drafter on it, and the
    drafter replicas swap in each version the learner's guard promotes. Off by default."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    method: Literal["eagle1", "hass", "eagle3"] = "eagle3"  # the drafting method that learns
    capture_bytes: int = Field(64 * 1024**2, gt=0)  # each target replica's capture buffer
    capture_age_s: float = Field(3600.0, gt=0)  # captured samples older than this are dropped
    push_period_s: float = Field(5.0, gt=0)  # how often a target replica hands its samples to the learner
    poll_period_s: float = Field(5.0, gt=0)  # how often a drafter replica asks for a new version
    lr: float = Field(1e-4, gt=0)
    steps_per_check: int = Field(40, ge=1)  # learner steps between verdicts
    warmup_steps: int = Field(40, ge=0)  # the learner's rate rises linearly over its first this many steps
    decay_steps: int = Field(10, ge=0)  # each verdict judges the candidate after this many steps of a rate falling to 0
    replay: int = Field(1024, ge=0)  # ShareGPT training samples replayed against forgetting (features made when read)
    margin: float = 0.0  # the chain-estimate gain a candidate's lower 95 % bound must exceed
    heldout_every: int = Field(4, ge=2)  # every n-th captured sample is kept for the guard, never trained on
    min_window: int = Field(8, ge=2)  # the guard judges no candidate on fewer such samples
    window: int = Field(64, ge=2)  # the guard's window keeps the newest this many samples
    epochs: float = Field(4.0, gt=0)  # the learner rests once it has drawn its samples this many times over
    # the share of wall time the learner trains (it rests the rest): on a small CPU host a learner at
    # full duty costs serving throughput even at nice 19 (docs/benchmarks.md, "Online learning")
    duty: float = Field(1.0, gt=0, le=1)
    out: str = "~/.cache/eyas/learned"  # promoted versions (a folder every replica can read)


class ServeConfig(BaseModel):
    """The application's arguments (``args:`` in ray_configs/serve.yaml)."""

    model_config = ConfigDict(extra="forbid")

    target: str = DEFAULT_TARGET
    precision: Literal[PRECISIONS] = "fp32"
    # the target's compute dtype at precision fp32 (half precision is made batch-invariant, so greedy
    # speculative output stays exact: docs/architecture.md, "Precision modes")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # where the replicas compute: "cpu", "cuda" or "cuda:N"; None = the GPU Ray assigned a replica
    # whose kind reserves one (`target_num_gpus` / `drafter_num_gpus` > 0; Ray makes it "cuda"),
    # else the CPU. Not yet run on a GPU.
    device: str | None = None
    methods: list[Literal["eagle1", "hass", "eagle3"]] = Field(default_factory=lambda: ["eagle3", "eagle1"])
    drafters: dict[str, str] = Field(default_factory=dict)  # method -> drafter folder (default: shipped)
    # replica counts: fixed, unless the kind's autoscaling config is given (then it rules)
    target_replicas: int = Field(1, ge=1)
    drafter_replicas: int = Field(1, ge=0)  # 0 = no drafter deployment: target-only serving
    target_autoscaling: dict | None = None  # a Ray Serve autoscaling_config (see eyas.autoscale.serve_policy)
    drafter_autoscaling: dict | None = None
    target_num_cpus: float = Field(1.0, ge=0)
    target_num_gpus: float = Field(0.0, ge=0)
    target_resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. {target_host: 1}
    drafter_num_cpus: float = Field(1.0, ge=0)
    drafter_num_gpus: float = Field(0.0, ge=0)
    drafter_resources: dict[str, float] = Field(default_factory=dict)
    torch_threads: int = Field(1, ge=1)
    target_timeout_s: float = Field(300.0, gt=0)
    drafter_timeout_s: float = Field(30.0, gt=0)  # the drafter's info (start-up, probes)
    # a drafter call inside a round (propose, open, reseed) slower than this makes the rounds plain at
    # once; a probe brings the drafter back when it answers again (a replaced replica, say)
    drafter_round_timeout_s: float = Field(2.0, gt=0)
    console_spans: bool = False
    # traces to an OTLP collector (host:port, gRPC), e.g. "127.0.0.1:4317"; needs the
    # opentelemetry-exporter-otlp-proto-grpc package. None = spans stay in memory (`eyas stats`).
    otlp_endpoint: str | None = None
    # "tree-work": a replica's live requests advance in batched rounds with per-request trees from the
    # latency curve; "prompt-length": batched rounds of similar prompt lengths, one fixed tree (the baseline)
    scheduler: Literal["tree-work", "prompt-length"] = "tree-work"
    max_batch: int = Field(16, ge=1)  # requests per batched round
    max_verify_rows: int = Field(256, ge=1)  # verify rows per batched round (all requests together)
    # prompt rows one round prefills, all requests together (chunked prefill): a long prompt takes
    # several rounds while the others keep decoding in the same forwards
    max_prefill_rows: int = Field(DEFAULT_PREFILL_CHUNK, ge=1)
    # MoE targets: expert weights one batched verify may read (the union its rows route to; design 0x09A);
    # None = no cap. Ignored for a dense target.
    max_expert_bytes: int | None = Field(None, ge=1)
    curve_repeats: int = Field(3, ge=1)  # timings per row count when the latency curve is measured
    kv_capacity_bytes: int = Field(2 * 1024**3, gt=0)  # a target replica's KV budget (the autoscaler's KV signal)
    # each target replica's prefix cache (committed K/V and features of prompts and answers seen before,
    # reused by a prompt that starts the same way); 0 = off. The default holds about 20,000 tokens of
    # the default target (53 KB a token with EAGLE-3's taps: docs/serving.md, "Prefix cache")
    prefix_cache_bytes: int = Field(1024**3, ge=0)
    # which target replica a request goes to: "prefix" = the one whose prefix cache most likely holds
    # its prompt's longest prefix (Ray Serve LLM's PrefixCacheAffinityRouter over token ids), unless the
    # replicas' queues differ by more than `prefix_router_imbalance` requests; "power-of-two" = Ray
    # Serve's default (eyas.serve.routing)
    target_router: Literal["prefix", "power-of-two"] = "prefix"
    prefix_router_imbalance: float = Field(2.0, ge=0)
    # clients must send `Authorization: Bearer <key>` (HTTP) or that metadata (gRPC); None = open.
    # `eyas serve --api-key` or EYAS_API_KEY set it too. Never logged.
    api_key: str | None = Field(None, min_length=1, repr=False)
    # GET /metrics without the API key (vLLM's habit: scrapers carry no key); false puts it behind the key.
    # GET /health is always open.
    metrics_open: bool = True
    # a request whose target replica dies resumes on another for this long before the client gets an error
    resume_timeout_s: float = Field(60.0, ge=0)
    served_model_name: str | None = None  # the OpenAI API's model id (default: the target's name)
    max_body_bytes: int = Field(1024**2, ge=1024)  # HTTP bodies larger than this are refused (413)
    # requests one ingress runs at once (streaming or not, every API); past it a request is refused as
    # overloaded at once (HTTP 503, gRPC RESOURCE_EXHAUSTED) instead of waiting without end
    max_inflight_requests: int = Field(256, ge=1)
    learn: LearnSettings = Field(default_factory=LearnSettings)

    @field_validator("target_autoscaling", "drafter_autoscaling")
    @classmethod
    def _autoscaling(cls, v: dict | None) -> dict | None:
        if v is not None:
            try:
                AutoscalingConfig(**v)
            except ValidationError as err:
                first = err.errors()[0]
                raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
        return v

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp(cls, v: str | None) -> str | None:
        import importlib.util

        if v is None:
            return v
        try:
            found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError("needs the opentelemetry-exporter-otlp-proto-grpc package (pip install it)")
        return v

    @model_validator(mode="after")
    def _learn_needs_its_drafter(self) -> ServeConfig:
        if self.learn.window < self.learn.min_window:
            raise ValueError(f"learn.window: {self.learn.window} is below learn.min_window ({self.learn.min_window})")
        if self.learn.enabled and (self.drafter_replicas == 0 or self.learn.method not in self.methods):
            raise ValueError(
                f"learn.method: {self.learn.method} must be served (methods: {self.methods}, drafter_replicas >= 1) "
                "for online learning"
            )
        return self

    @model_validator(mode="after")
    def _dtype_needs_fp32(self) -> ServeConfig:
        check_dtype(self.dtype, self.precision)
        if self.device is not None:  # its syntax and precision here; whether it exists, on the replica
            check_device(self.device, self.precision, here=False)
        for kind in REPLICA_KINDS:
            if self.device is None and self.num_gpus(kind) > 0 and self.precision != "fp32":
                raise ValueError(
                    f"precision: {self.precision} ({CPU_KERNELS[self.precision]}) runs on the CPU only, not on the "
                    f"GPU that {kind}_num_gpus reserves (set device: cpu, or precision: fp32)"
                )
        return self

    def num_gpus(self, kind: str) -> float:
        return self.target_num_gpus if kind == "target" else self.drafter_num_gpus

    def device_for(self, kind: str) -> str:
        """Where a ``kind`` ("target" | "drafter") replica computes: ``device`` when set, else "cuda"
        (the GPU Ray assigned it) for a kind that reserves GPUs, else "cpu"."""
        assert kind in REPLICA_KINDS, kind
        if self.device is not None:
            return self.device
        return "cuda" if self.num_gpus(kind) > 0 else "cpu"

    def warnings(self) -> list[str]:
        """What this config asks for that would not do what it seems to: GPUs reserved for replicas
        that compute on the CPU, or a GPU device for replicas that reserve none."""
        out = []
        for kind in REPLICA_KINDS:
            gpus, device = self.num_gpus(kind), self.device_for(kind)
            if gpus > 0 and device == "cpu":
                out.append(
                    f"{kind}_num_gpus: {gpus:g} reserves GPUs that each {kind} replica does not use: device is cpu"
                )
            elif gpus == 0 and device.startswith("cuda"):
                out.append(
                    f"device: {device} for {kind} replicas that reserve no GPU ({kind}_num_gpus: 0): "
                    f"Ray does not place them by GPU"
                )
        return out


def parse_config(config: dict | None) -> ServeConfig:
    try:
        return ServeConfig.model_validate(config or {})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])  # empty for a check across fields, whose message names it
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"config.{where}: {message}" if where else f"config.{message}") from None
