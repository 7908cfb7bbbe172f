"""The ``eyas`` command line.

    eyas generate --prompt TEXT [--method target|eagle1|eagle3] [--drafter PATH] [--max-new-tokens N]
                  [--temperature T] [--top-p P] [--top-k K] [--seed S] [--tree-kind dynamic|static|chain]
                  [--tree-depth D --tree-width W --tree-budget B] [--tree-min-value V --tree-expand-min-value V]
                  [--precision fp32|fp16w|int8|gguf] [--raw] [--json]
    eyas generate --server HOST:PORT ...   the same flags and --json output, over the Eyas gRPC service
    eyas demo [--prompt TEXT]     speculative vs target-only on the default model, with the speedup
    eyas serve [--config ray_configs/serve.yaml] [--grpc-port 9000] [--http-port 8000]
                                  start a local Ray and the Serve application (Ctrl-C stops it)
    eyas stats --server HOST:PORT  every replica's telemetry, tree work and leak invariant
    eyas export --drafter DIR --format speculators|sglang|eagle --out DIR [--target T]
                                  write a drafter in vLLM speculators', SGLang/SpecForge's or SafeAILab's layout
    eyas import --from DIR [--format speculators|sglang|eagle] --out DIR [--target T]
                                  bind an ecosystem EAGLE checkpoint to the target as an Eyas drafter
    eyas trim-vocab --drafter DIR --size N --out DIR [--answers-dir data/regen] [--target T]
                                  cut an EAGLE-3 drafter's draft vocabulary to its N most frequent tokens
    eyas experiment autoscale --workload ray_configs/workloads/step_burst.yaml [--out DIR] [--address A]
                                  replay a workload on a fake multi-node cluster; timeline JSON + plot

Bad input exits with status 2 and one line ``error: <field>: <why>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

from eyas.protocol.schema import METHODS


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="the user message (wrapped in the chat template unless --raw)")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    p.add_argument(
        "--messages",
        help='a conversation instead of --prompt: a JSON list of {"role", "content"} '
        "turns (system, user, assistant; the last the user's), or @FILE holding one",
    )
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument(
        "--method",
        default="eagle3",
        metavar="{" + ",".join(METHODS) + "}",
        help="the drafter, or target-only decoding, or suffix drafts alone (default eagle3)",
    )
    p.add_argument(
        "--suffix-drafts",
        action="store_true",
        help="graft suffix drafts (from the prompt and answer) into the drafter's tree",
    )
    p.add_argument("--drafter", help="a drafter checkpoint folder (default: the one shipped for the method)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--ignore-eos", action="store_true", help="run on past end-of-sequence tokens to --max-new-tokens (vLLM's)"
    )
    p.add_argument("--stop-token-ids", help="comma-separated token ids that end the answer (vLLM's stop_token_ids)")
    p.add_argument(
        "--min-tokens", type=int, default=0, help="no end of the answer before this many tokens (vLLM's min_tokens)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="over the answer so far, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="over the answer so far, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and answer; 1 = off")
    p.add_argument(
        "--logit-bias", default=None, help="JSON object: token id -> bias in [-100, 100], e.g. '{\"2\": -100}'"
    )
    p.add_argument(
        "--response-format",
        default=None,
        help='structured output, OpenAI\'s response_format as JSON (\'{"type": "json_object"}\'), or @FILE',
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree-kind", default="dynamic", choices=["dynamic", "static", "chain"])
    p.add_argument("--tree-depth", type=int)
    p.add_argument("--tree-width", type=int)
    p.add_argument("--tree-budget", type=int)
    p.add_argument("--tree-min-value", type=float, help="cost-aware tree: a verified node's path-value floor")
    p.add_argument("--tree-expand-min-value", type=float, help="cost-aware tree: an expanded node's path-value floor")
    p.add_argument(
        "--precision",
        default="fp32",
        metavar="{fp32,fp16w,int8,gguf}",
        help="served precision of the target: fp32 | fp16w (fp16 weights, fp32 compute) | int8 | gguf (the GGUF's own 4/8-bit blocks, llama.cpp's arithmetic)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        metavar="{float32,bfloat16,float16}",
        help="compute dtype at precision fp32: float32 | bfloat16 | float16 (the drafter follows)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (precision fp32; not yet run on a GPU)")
    p.add_argument("--target", default="smollm2-135m", help="smollm2-135m, a .gguf file, or an HF checkpoint dir")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    p.add_argument(
        "--request-id", help="name the request (so that `eyas cancel` can stop it); default: the server names it"
    )


def _logit_bias(raw: str | None) -> dict:
    if raw is None:
        return {}
    try:
        bias = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"logit_bias: not valid JSON ({err.msg})") from None
    if not isinstance(bias, dict):
        raise ValueError("logit_bias: expected a JSON object of token id -> bias")
    return bias


def _response_format(raw: str | None) -> dict | None:
    if raw is None:
        return None
    from pathlib import Path

    text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"response_format: not valid JSON ({err.msg})") from None


def _ids(text: str | None, field: str) -> list[int]:
    """A flag's comma-separated token ids ([] for none), a ValueError naming ``field`` otherwise."""
    try:
        return [int(x) for x in (text or "").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{field}: must be comma-separated integers") from None


def _request(args, method: str | None = None):
    from eyas.protocol.schema import parse_request

    ids = _ids(args.prompt_ids, "prompt_ids") if args.prompt_ids else None
    messages = None
    if getattr(args, "messages", None):
        import json
        from pathlib import Path

        raw = Path(args.messages[1:]).read_text() if args.messages.startswith("@") else args.messages
        try:
            messages = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"messages: not valid JSON ({err.msg})") from None
    return parse_request(
        prompt=args.prompt,
        prompt_ids=ids,
        messages=messages,
        raw=args.raw,
        method=method or args.method,
        suffix_drafts=getattr(args, "suffix_drafts", False) and method not in ("target", "suffix"),
        max_new_tokens=args.max_new_tokens,
        ignore_eos=getattr(args, "ignore_eos", False),
        stop_token_ids=_ids(getattr(args, "stop_token_ids", None), "stop_token_ids"),
        min_tokens=getattr(args, "min_tokens", 0),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=_logit_bias(args.logit_bias),
        response_format=_response_format(getattr(args, "response_format", None)),
        seed=args.seed,
        drafter=args.drafter,
        tree_kind=args.tree_kind,
        tree_depth=args.tree_depth,
        tree_width=args.tree_width,
        tree_budget=args.tree_budget,
        tree_min_value=args.tree_min_value,
        tree_expand_min_value=args.tree_expand_min_value,
        request_id=args.request_id,
    )


def cmd_generate(args) -> int:
    req = _request(args)  # validate before the (slow) model load
    if args.server:
        return _generate_remote(args, req)
    from eyas.runtime import Eyas, set_threads
    from eyas.target.loader import check_placement

    check_placement(args.device, args.dtype, args.precision)  # before the (slow) model load
    set_threads(args.threads)
    eyas = Eyas(args.target, args.precision, dtype=args.dtype, device=args.device)
    _, report = eyas.generate(req)
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0


def _generate_remote(args, req) -> int:
    from eyas.serve.client import EyasClient

    if req.drafter is not None:
        raise ValueError("drafter: --drafter is a server-side choice (ray_configs/serve.yaml), not a request field")
    fields = req.model_dump(exclude_none=True)
    with EyasClient(args.server, api_key=_client_key()) as client:
        if args.json:
            print(json.dumps(client.generate(**fields)))
            return 0
        stats = None
        # closed before the channel, so that Ctrl-C cancels the request (call and name) on the server
        with contextlib.closing(client.stream(**fields)) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)
                stats = chunk.stats if chunk.finish_reason else stats
        print()
        if stats is not None:
            print(
                f"[{req.method}] {stats.new_tokens} tokens in {stats.wall_ms / 1000:.2f} s, {stats.rounds} target "
                f"forwards, tau = {stats.tau:.2f}{' (drafter fallback)' if stats.drafter_fallback else ''}",
                file=sys.stderr,
            )
    return 0


def _client_key() -> str | None:
    """The API key a client command sends to a server started with one (``EYAS_API_KEY``)."""
    import os

    return os.environ.get("EYAS_API_KEY") or None


def _print_report(report: dict) -> None:
    print(report["text"])
    print(
        f"\n[{report['method']}] {report['new_tokens']} tokens in {report['wall_s']:.2f} s "
        f"({report['tokens_per_s']:.1f} tok/s), {report['target_forwards']} target forwards, "
        f"tau = {report['accept_length_mean']:.2f}",
        file=sys.stderr,
    )


def cmd_demo(args) -> int:
    from eyas.runtime import Eyas, set_threads

    if args.repeats < 1:
        print(f"error: --repeats: must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    spec_req = _request(args)
    base_req = _request(args, method="target")
    set_threads(args.threads)
    print(f"loading the default target ({args.target}, {args.precision}) ...", flush=True)
    eyas = Eyas(args.target, args.precision)
    for req in (base_req, spec_req):  # warm-up, not timed: each method's first call allocates
        eyas.generate(req.model_copy(update={"max_new_tokens": 4}))
    runs = {"target": [], "spec": []}
    for _ in range(args.repeats):  # alternating, so that a slow moment of the machine hits both
        runs["target"].append(eyas.generate(base_req)[1])
        runs["spec"].append(eyas.generate(spec_req)[1])
    base, spec = (sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2] for rs in runs.values())
    print("\n" + spec["text"] + "\n")
    print(f"{'method':<10} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'tau':>5}   (the median of {args.repeats} runs)")
    for r in (base, spec):
        print(
            f"{r['method']:<10} {r['new_tokens']:>6} {r['wall_s']:>7.2f} {r['tokens_per_s']:>7.1f} "
            f"{r['accept_length_mean']:>5.2f}"
        )
    same = all(r["token_ids"] == base["token_ids"] for r in runs["target"] + runs["spec"])
    print(
        f"speedup {spec['tokens_per_s'] / max(base['tokens_per_s'], 1e-9):.2f}x over target-only "
        f"(greedy outputs {'identical' if same else 'DIFFERENT'}; drafter: {spec['drafter']})"
    )
    return 0


def cmd_train(args) -> int:
    from eyas.runtime import Eyas, set_threads
    from eyas.training.config import load_config, validated
    from eyas.training.prepare import prepare_features
    from eyas.training.trainer import DrafterTrainer

    cfg = load_config(args.config)
    if args.method and args.method != cfg.method:
        cfg = cfg.model_copy(update={"method": args.method})
    if args.out:
        cfg = cfg.model_copy(update={"out": args.out})
    if args.threads:
        cfg = cfg.model_copy(update={"threads": args.threads})
    overrides = {key: getattr(args, key) for key in ("device", "dtype") if getattr(args, key)}
    if overrides:
        cfg = validated({**cfg.model_dump(), **overrides})  # checked, naming the field
    from eyas.target.loader import check_device

    check_device(cfg.device)  # here, before the (slow) load
    set_threads(cfg.threads)
    from eyas.compute import keep_freed_memory

    keep_freed_memory()  # a training step's large temporaries reuse freed memory (eyas.compute)
    eyas = Eyas(cfg.target, "fp32", device=cfg.device)  # the frozen target extracts the features there
    train, heldout = prepare_features(cfg, eyas)
    counts = None
    if cfg.rebuild_draft_vocab:
        from eyas.training.prepare import answer_token_counts

        counts = answer_token_counts(cfg, eyas.tokenizer, eyas.model.cfg.vocab_size)
    trainer = DrafterTrainer(cfg, eyas.model, eyas.loaded.fingerprint.to_dict(), train, heldout, vocab_counts=counts)
    summary = trainer.fit()
    if "stopped_at" in summary:
        return 1
    if cfg.schedule == "wsd" and summary["points"]:
        for tokens, point in summary["points"].items():
            print(
                f"point {tokens}: {point['drafter']} (held-out top-1 {[round(x, 3) for x in point['heldout']['top1']]})"
            )
        return 0
    path = trainer.export(summary)
    print(f"drafter written to {path} ({summary['steps']} steps, {summary['wall_s']} s)")
    return 0


SERVE_ENDPOINT_DEFAULTS = {"host": "127.0.0.1", "http_port": 8000, "grpc_port": 9000}


def cmd_serve(args) -> int:
    import os
    import signal
    import time

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local: `serve status/deploy` need no token
    from eyas.serve.app import GRPC_SERVICER_FUNCTIONS, build_app, parse_config
    from eyas.serve.serve_file import ServeFile, read_serve_file

    # the whole file or a refusal naming what cannot be applied; one without an `eyas` application is an error
    served = read_serve_file(args.config) if args.config else ServeFile()
    app_args, file_endpoints = served.args, served.endpoints
    api_key = args.api_key or os.environ.get("EYAS_API_KEY")
    if api_key:
        app_args = {**app_args, "api_key": api_key}
    app_args = {**app_args, **{k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}}
    app_args = {**app_args, **_model_args(args, app_args)}
    config = parse_config(app_args)  # a bad config fails here, naming the field, before Ray starts
    config_warnings = config.warnings()
    flags = {"host": args.host, "http_port": args.http_port, "grpc_port": args.grpc_port}
    # addresses: a flag, else the file's http_options / grpc_options, else the defaults
    endpoints = {**SERVE_ENDPOINT_DEFAULTS, **file_endpoints, **{k: v for k, v in flags.items() if v is not None}}
    if args.check_config:  # (a real start warns through build_app's log, once)
        for warning in config_warnings:
            print(f"warning: config.{warning}", file=sys.stderr)
        shown = {**app_args, **({"api_key": "<set>"} if app_args.get("api_key") else {})}  # never print the key
        print(
            json.dumps(
                {
                    "endpoints": endpoints,
                    "args": shown,
                    "devices": {kind: config.device_for(kind) for kind in ("target", "drafter")},
                    **({"route_prefix": served.route_prefix} if served.route_prefix != "/" else {}),
                    **({"proxy_location": served.proxy_location} if served.proxy_location else {}),
                    **({"deployments": served.deployment_options} if served.deployment_options else {}),
                    **({"warnings": [f"config.{w}" for w in config_warnings]} if config_warnings else {}),
                }
            )
        )
        return 0
    import ray
    from ray import serve

    host, http_port, grpc_port = endpoints["host"], endpoints["http_port"], endpoints["grpc_port"]
    ray.init(
        address=args.address,
        include_dashboard=False,
        **({"num_cpus": args.num_cpus} if args.num_cpus and not args.address else {}),
    )
    serve.start(
        http_options={"host": host, "port": http_port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
        **({"proxy_location": served.proxy_location} if served.proxy_location else {}),
    )
    serve.run(build_app(app_args, served.deployment_options), name="eyas", route_prefix=served.route_prefix)
    print(
        f"eyas serving: gRPC {host}:{grpc_port} (eyas.v1.Eyas), HTTP http://{host}:{http_port}{served.route_prefix.rstrip('/')}/ "
        f"(OpenAI API under /v1{', API key required' if app_args.get('api_key') else ''})"
        f"  -- try: eyas generate --server 127.0.0.1:{grpc_port} --prompt 'Hello'",
        flush=True,
    )
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


def _model_args(args, app_args: dict) -> dict:
    """``eyas serve MODEL [--precision P] [--drafter DIR]`` as app args: the drafter's manifest names
    its method; another target than the default with no drafter of its own serves target-only (and
    suffix drafts), since the shipped drafters are bound to the default target."""
    from pathlib import Path

    from eyas.target.loader import DEFAULT_TARGET

    out: dict = {}
    if args.model:
        if args.model != DEFAULT_TARGET and not Path(args.model).exists():
            raise ValueError(
                f"model: {args.model!r} is neither {DEFAULT_TARGET} nor an existing .gguf file or checkpoint folder"
            )
        out["target"] = args.model
    if args.precision:
        out["precision"] = args.precision
    if args.drafter:
        from eyas.drafting.manifest import read_manifest

        if not Path(args.drafter).is_dir():
            raise ValueError(f"drafter: {args.drafter} is not a drafter folder")
        method = read_manifest(Path(args.drafter)).method
        out.update(methods=[method], drafters={method: args.drafter})
    elif args.model and args.model != DEFAULT_TARGET and not app_args.get("drafters"):
        print(
            f"note: no --drafter for {args.model}: serving target-only and suffix drafts (the shipped drafters "
            f"belong to {DEFAULT_TARGET})",
            file=sys.stderr,
        )
        out.update(methods=[], drafter_replicas=0)
    return out


def cmd_stats(args) -> int:
    from eyas.serve.client import EyasClient

    with EyasClient(args.server, api_key=_client_key()) as client:
        print(json.dumps(client.stats(), indent=1))
    return 0


def cmd_cancel(args) -> int:
    from eyas.serve.client import EyasClient

    with EyasClient(args.server, api_key=_client_key()) as client:
        client.cancel(args.request_id)
    print(f"cancel sent for {args.request_id!r} (a no-op if it is not running)")
    return 0


def cmd_experiment(args) -> int:
    from eyas.experiments.experiment import run_autoscale
    from eyas.experiments.workload import load_workload

    workload = load_workload(args.workload)
    out = args.out or f"bench/results/autoscale-{workload.name}"
    doc = run_autoscale(
        workload,
        out,
        serve_config=args.serve_config,
        cluster_config=args.cluster_config,
        address=args.address,
        check=not args.no_check,
        plan_rates=tuple(args.plan_rates),
        precision=args.precision,
        max_target_replicas=args.max_target_replicas,
    )
    print_experiment_summary(doc, out)
    report = doc.get("report") or {}
    ok = doc["errors"] == 0 and doc["incorrect"] == 0 and (report.get("success") or not report.get("expected"))
    return 0 if ok else 1


def cmd_experiment_learn(args) -> int:
    from eyas.experiments.learn import read_prompts, run_learn, traffic_split
    from eyas.learning.learner import LearnConfig

    if args.traffic not in ("stubs", "humaneval"):
        traffic = read_prompts(args.traffic, "traffic")
        heldout = read_prompts(args.heldout, "heldout") if args.heldout else []
        if not heldout:
            raise ValueError("heldout: --traffic FILE needs --heldout FILE (prompts of the same kind, never served)")
    else:
        heldout, traffic = traffic_split(args.traffic)
    if args.limit:
        traffic, heldout = traffic[: args.limit], heldout[: max(2, args.limit // 3)]
    record = run_learn(
        traffic,
        heldout,
        precision=args.precision,
        threads=args.threads,
        max_new_tokens=args.max_new_tokens,
        passes=args.passes,
        chunk=args.chunk,
        mtbench_limit=args.mtbench,
        replay=args.replay,
        steps_per_check=args.steps_per_check,
        duty=args.duty,
        minutes=args.minutes,
        pause_every=args.pause_every,
        out=args.out,
        learn_config=LearnConfig(
            lr=args.lr, dtype=args.dtype, decay_steps=args.decay_steps, warmup_steps=args.warmup_steps
        ),
    )
    if args.json:
        keys = (
            "tau_before",
            "tau_after",
            "mtbench_tau_before",
            "mtbench_tau_after",
            "tokens_learned",
            "serve_tok_s_learning_on",
            "serve_tok_s_learning_off",
        )
        Path(args.json).write_text(json.dumps({k: record[k] for k in keys}, indent=1))
    print(
        f"held-out τ {record['tau_before']:.3f} -> {record['tau_after']:.3f}; MT-bench τ "
        f"{_num(record['mtbench_tau_before'])} -> {_num(record['mtbench_tau_after'])}; "
        f"{record['tokens_learned']} served tokens learned, live version {record['live_version']}; serving "
        f"{record['serve_tok_s_learning_on']:.1f} tok/s with the learner beside, "
        f"{record['serve_tok_s_learning_off']:.1f} without ({args.out}/learn.json, learn.png)"
    )
    return 0


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def print_experiment_summary(doc: dict, out: str) -> None:
    def f(x, unit="s"):
        return "-" if x is None else f"{x:.2f} {unit}".strip()

    cal = doc.get("calibration") or {}
    if cal:
        runs = cal["runs"]
        each = ", ".join(f"{len(r['output_tokens']) / r['makespan_s']:.2f}" for r in runs if r["makespan_s"])
        print(
            f"\ncapacity of one target replica: {cal['capacity_per_s']:.2f} req/s "
            f"(median of {len(runs)} closed loops of {runs[0]['requests']} requests, {runs[0]['concurrency']} in flight: "
            f"{each}; "
            f"p50 latency {f(runs[0]['p50_latency_s'])}; pending verify rows at capacity {cal['rows_at_capacity']:.0f}, "
            f"the policy's threshold {cal['threshold_rows_per_replica']:g} a replica)"
        )
        rates = ", ".join(
            f"{a}{'' if b is None else f' -> {b}'} = {x:.2f}{'' if y is None or y == x else f' -> {y:.2f}'} req/s"
            for (a, b), (x, y) in zip(cal["rates"], cal["rates_per_s"])
        )
        print(f"phases: {rates}")
    print(
        f"\nrequests {doc['requests']}: {doc['errors']} errors, {doc['incorrect']} incorrect "
        f"(checked against target-only: {doc['checked']})"
    )
    print(
        f"p50 / p99 latency: {f(doc['p50_latency_s'])} / {f(doc['p99_latency_s'])}; "
        f"p99 steady {f(doc.get('p99_steady_s'))}, in the load window {f(doc.get('p99_window_s'))}"
    )
    rep = doc.get("report") or {}
    if rep:
        th, rp, nd = rep["threshold"], rep["replica"], rep.get("node") or {}
        w0, w1 = rep["window"]
        print(
            f"load window {w0:.0f}-{w1:.0f} s: pending verify rows per target replica peaked at "
            f"{th['peak_rows_per_replica']:.0f} (threshold {th['rows_per_replica']:g}); crossed at {f(th['crossed_at'])}"
        )
        print(
            f"target replica: asked for at {f(rp['asked_at'])}, running at {f(rp['running_at'])}, "
            f"back to {rep['initial_replicas']} at {f(rp['back_at'])} (peak {rp['peak']})"
        )
        if nd:
            print(
                f"target node: asked for at {f(nd['asked_at'])}, running at {f(nd['running_at'])}, "
                f"given back at {f(nd['back_at'])} (peak {nd['peak']})"
            )
        verdict = (
            "SUCCESS: scaled up in the load window and back down after"
            if rep["success"]
            else f"NOT A SUCCESS: {rep['why']}"
        )
        print(verdict if rep.get("expected", True) else rep["why"])
    sim = doc.get("simulator", {})
    if sim:
        print(f"\n{'simulator (fitted on the calibration) vs measured':<30}")
        print(f"{'':<26} {'predicted':>10} {'interval':>17} {'measured':>10} {'error':>8}")
        for key, p in sim["predicted"].items():
            m, err, iv = sim["measured"].get(key), sim.get("error", {}).get(key), sim["interval"].get(key)
            span = "-" if iv is None else f"[{_num(iv[0])}, {_num(iv[1])}]"
            print(f"{key:<26} {_num(p):>10} {span:>17} {_num(m):>10} {'-' if err is None else f'{100 * err:+.0f}%':>8}")
        if sim.get("plan"):
            print(f"\n{'plan: rate/s':<14} {'replicas':>9} {'nodes':>6} {'p50 s':>7} {'p99 s':>7} {'tok/s':>9}")
            for row in sim["plan"]:
                print(
                    f"{row['rate_per_s']:<14g} {row['peak_replicas']:>9} {row['peak_nodes']:>6} "
                    f"{row['p50_latency_s']:>7.2f} {row['p99_latency_s']:>7.2f} {row['tokens_per_s']:>9.0f}"
                )
    print(f"\nwritten: {out}/timeline.json, {out}/timeline.png, {out}/requests.jsonl")


def cmd_export(args) -> int:
    from eyas.drafting.interop import export_drafter
    from eyas.drafting.manifest import check_compatible, read_manifest
    from eyas.target.loader import load_target_head

    embed = None
    if args.format == "eagle":  # SafeAILab's checkpoint holds the target's embedding
        head = load_target_head(args.target)
        check_compatible(read_manifest(args.drafter), head.fingerprint)
        embed = head.embed.weight
    out = export_drafter(args.drafter, args.format, args.out, verifier=args.target, embed=embed)
    print(f"exported {args.drafter} as {args.format} to {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def cmd_import(args) -> int:
    from eyas.drafting.interop import import_drafter
    from eyas.target.loader import load_target_head

    head = load_target_head(args.target)
    done = import_drafter(args.from_dir, head.cfg, head.fingerprint.to_dict(), args.out, fmt=args.format)
    print(
        f"imported a {done.format} {done.method} drafter to {done.folder} for {args.target} "
        f"(taps {[layer for layer, _ in done.taps]}); use it with --drafter {done.folder}"
    )
    return 0


def cmd_trim_vocab(args) -> int:
    from pathlib import Path

    from eyas.drafting.manifest import check_compatible, read_manifest, trim_drafter_vocab
    from eyas.target.loader import load_target_head, load_tokenizer
    from eyas.training.prepare import answers_token_counts, train_answer_files

    files = train_answer_files(args.answers_dir, args.target, "--answers-dir")
    source = read_manifest(args.drafter)  # a missing or bad manifest is named before the slow count
    old_size = source.drafter_config.get("draft_vocab_size")
    if source.method != "eagle3":
        raise ValueError(
            f"--drafter: {args.drafter} is an {source.method} drafter; only EAGLE-3 has a draft vocabulary"
        )
    if not isinstance(old_size, int) or not 1 <= args.size <= old_size:
        raise ValueError(f"--size: must lie in [1, {old_size}] (the drafter's draft vocabulary), got {args.size}")
    head = load_target_head(args.target)
    check_compatible(source, head.fingerprint)  # the target's drafter, or refused by field, before the count
    tokenizer, vocab = load_tokenizer(args.target), head.cfg.vocab_size
    counts = answers_token_counts(files, tokenizer, vocab, args.max_len)
    note = (
        f"the {args.size:,} most frequent (in {', '.join(p.name for p in files)}) of the {old_size:,} "
        "tokens it was trained with, their head rows as trained"
    )
    trimmed, _, old_d2t = trim_drafter_vocab(args.drafter, args.out, head.fingerprint, counts, args.size, note)
    coverage = {"train answers": counts}
    if held := sorted(Path(args.answers_dir).glob(f"{args.target}-sharegpt-heldout*.answers.jsonl")):
        coverage["held-out answers"] = answers_token_counts(held, tokenizer, vocab, args.max_len)
    for label, c in coverage.items():
        total = max(int(c.sum()), 1)
        print(
            f"coverage of the {label}' tokens: {100 * int(c[old_d2t].sum()) / total:.2f} % at {old_size:,}"
            f" -> {100 * int(c[trimmed.d2t].sum()) / total:.2f} % at {args.size:,}"
        )
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    print(f"trimmed drafter written to {args.out} ({size / 2**20:.2f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eyas", description="EAGLE-family speculative decoding")
    parser.add_argument("--version", action="version", version=f"eyas {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer")
    _add_generate_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--server", help="HOST:PORT of a running `eyas serve` / `serve run` (gRPC); default: in-process")
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="speculative vs target-only on the default model")
    _add_generate_flags(d)
    d.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each method, alternating (the median is shown)"
    )
    d.set_defaults(func=cmd_demo, prompt="Explain in three sentences why the sky is blue.")
    t = sub.add_parser("train", help="train a drafter for the target (EAGLE-1, HASS or EAGLE-3)")
    t.add_argument("--method", choices=["eagle1", "hass", "eagle3"], help="overrides the config's method")
    t.add_argument("--config", required=True, help="a training YAML (see configs/)")
    t.add_argument("--out", help="overrides the config's output folder")
    t.add_argument("--threads", type=int, help="overrides the config's torch CPU threads (a resumed run may change it)")
    t.add_argument("--device", help="overrides the config's device: cpu | cuda | cuda:N (not yet run on a GPU)")
    t.add_argument("--dtype", help="overrides the config's autocast dtype: float32 | bfloat16 | float16")
    t.set_defaults(func=cmd_train)
    s = sub.add_parser("serve", help="start a local Ray and the Eyas Serve application")
    s.add_argument(
        "model",
        nargs="?",
        help="the target to serve: smollm2-135m, a .gguf file or an HF checkpoint folder (overrides the config's); "
        "another model than the default serves target-only and suffix drafts unless --drafter names one for it",
    )
    s.add_argument("--precision", metavar="{fp32,fp16w,int8,gguf}", help="the target's served precision")
    s.add_argument("--drafter", help="a drafter folder bound to the target (its manifest's method is served)")
    s.add_argument(
        "--config",
        help="a Serve config (ray_configs/serve.yaml): the eyas application's args, route_prefix and deployments "
        "options, the proxies' addresses and proxy_location; what it cannot apply is refused, named",
    )
    s.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    s.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray (default: all cores)")
    s.add_argument("--host", help="HTTP proxy host (default: the config's http_options.host, else 127.0.0.1)")
    s.add_argument("--grpc-port", type=int, help="gRPC port (default: the config's grpc_options.port, else 9000)")
    s.add_argument("--http-port", type=int, help="HTTP port (default: the config's http_options.port, else 8000)")
    s.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on HTTP and gRPC (default: "
        "$EYAS_API_KEY, else the config's api_key, else none)",
    )
    s.add_argument(
        "--device",
        help="where the replicas compute: cpu | cuda | cuda:N (overrides the config's "
        "device; default: the GPU Ray assigns a replica that reserves one, else cpu; not yet run on a GPU)",
    )
    s.add_argument(
        "--dtype", help="compute dtype at precision fp32: float32 | bfloat16 | float16 (overrides the config's)"
    )
    s.add_argument(
        "--check-config",
        action="store_true",
        help="validate the config, print the addresses and app args it resolves to as JSON, and exit",
    )
    s.set_defaults(func=cmd_serve)
    st = sub.add_parser("stats", help="telemetry of a running server")
    st.add_argument("--server", default="127.0.0.1:9000")
    st.set_defaults(func=cmd_stats)
    c = sub.add_parser("cancel", help="stop a named request (generate --request-id) on a running server")
    c.add_argument("request_id")
    c.add_argument("--server", default="127.0.0.1:9000")
    c.set_defaults(func=cmd_cancel)
    fmts = ["speculators", "sglang", "eagle"]
    e = sub.add_parser("export", help="write an Eyas drafter in an ecosystem layout (vLLM, SGLang, SafeAILab)")
    e.add_argument("--drafter", required=True, help="an Eyas drafter folder (manifest.json + model.safetensors)")
    e.add_argument("--format", required=True, choices=fmts)
    e.add_argument("--out", required=True, help="the folder to write (config.json + weights)")
    e.add_argument(
        "--target",
        default="smollm2-135m",
        help="the verifier the export names (and, for eagle, whose embedding it holds)",
    )
    e.set_defaults(func=cmd_export)
    im = sub.add_parser("import", help="bind an ecosystem EAGLE checkpoint to the target as an Eyas drafter")
    im.add_argument(
        "--from", dest="from_dir", required=True, help="a speculators, SGLang/SpecForge or SafeAILab folder"
    )
    im.add_argument("--format", choices=fmts, help="default: detected from its config.json")
    im.add_argument("--out", required=True, help="the Eyas drafter folder to write")
    im.add_argument("--target", default="smollm2-135m", help="the target it is checked against and bound to")
    im.set_defaults(func=cmd_import)
    tv = sub.add_parser(
        "trim-vocab", help="cut an EAGLE-3 drafter's draft vocabulary to its N most frequent tokens (head rows kept)"
    )
    tv.add_argument("--drafter", required=True, help="an Eyas EAGLE-3 drafter folder")
    tv.add_argument("--size", type=int, required=True, help="tokens to keep (at most the drafter's draft vocabulary)")
    tv.add_argument("--out", required=True, help="the folder to write")
    tv.add_argument(
        "--answers-dir",
        default="data/regen",
        help="where the target's answers to the train split are (<target>-sharegpt-train*.answers.jsonl): "
        "the counts; a held-out file there is reported as coverage",
    )
    tv.add_argument("--target", default="smollm2-135m", help="the target the drafter belongs to (its tokenizer)")
    tv.add_argument("--max-len", type=int, default=1024, help="render limit of a sample, as in training")
    tv.set_defaults(func=cmd_trim_vocab)
    ex = sub.add_parser("experiment", help="cluster experiments")
    exs = ex.add_subparsers(dest="experiment", required=True)
    a = exs.add_parser("autoscale", help="replay a workload against the autoscaling app; record a timeline")
    a.add_argument("--workload", required=True, help="a workload YAML (ray_configs/workloads/)")
    a.add_argument("--out", help="output folder (default bench/results/autoscale-<workload>)")
    a.add_argument(
        "--serve-config", help="Serve config whose eyas app is deployed (default ray_configs/autoscale.yaml)"
    )
    a.add_argument("--cluster-config", help="fake multi-node cluster config (default ray_configs/fake_cluster.yaml)")
    a.add_argument("--address", help="run on this running Ray cluster instead of starting the fake one")
    a.add_argument(
        "--precision",
        metavar="{fp32,fp16w,int8,gguf}",
        help="serve the target at this precision instead of the config's (a faster or slower replica)",
    )
    a.add_argument(
        "--max-target-replicas",
        type=int,
        help="let the target deployment grow to N replicas (Serve's bound and the policy's; the fake cluster has 5 target hosts)",
    )
    a.add_argument("--no-check", action="store_true", help="skip the target-only exactness check of every answer")
    a.add_argument(
        "--plan-rates",
        type=float,
        nargs="*",
        default=[100.0, 1000.0],
        help="arrival rates (req/s) the calibrated simulator plans for after the run",
    )
    a.set_defaults(func=cmd_experiment)
    le = exs.add_parser("learn", help="serve traffic with online drafter learning on; τ before and after")
    le.add_argument(
        "--traffic",
        default="stubs",
        help='what to serve: "stubs" (function stubs from the installed wheels\' sources, thousands), '
        '"humaneval" (the learn extra) or a .jsonl of {"prompt": ...}',
    )
    le.add_argument("--heldout", help="a .jsonl of prompts of the same kind, never served while learning")
    le.add_argument("--precision", choices=["fp32", "fp16w", "gguf"], default="gguf")
    le.add_argument(
        "--threads",
        type=int,
        default=1,
        help="serving threads (1: the learner, one thread at nice 19, takes the other core)",
    )
    le.add_argument("--max-new-tokens", type=int, default=128)
    le.add_argument("--passes", type=int, default=1, help="times the traffic is served")
    le.add_argument("--minutes", type=float, help="stop serving the traffic after this many minutes")
    le.add_argument(
        "--pause-every", type=int, default=2, help="pause the learner for every N-th chunk (its cost to serving)"
    )
    le.add_argument("--chunk", type=int, default=8, help="requests between learner checks and swaps")
    le.add_argument("--mtbench", type=int, default=80, help="MT-bench first turns for the forgetting check")
    le.add_argument("--replay", type=int, default=1024, help="ShareGPT training samples the learner replays")
    le.add_argument("--steps-per-check", type=int, default=40, help="learner steps between verdicts")
    le.add_argument(
        "--decay-steps",
        type=int,
        default=10,
        help="a verdict judges the candidate after this many steps of a falling rate",
    )
    le.add_argument("--lr", type=float, default=1e-4)
    le.add_argument("--warmup-steps", type=int, default=40, help="the learner's rate rises over its first N steps")
    le.add_argument("--duty", type=float, default=1.0, help="the share of wall time the learner may train")
    le.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the learner's autocast dtype")
    le.add_argument("--limit", type=int, help="serve only the first N traffic prompts (a quick run)")
    le.add_argument("--out", default="bench/results/learn")
    le.add_argument("--json", help="also write the headline numbers here")
    le.set_defaults(func=cmd_experiment_learn)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a gRPC call's failure: one line naming the server, never a traceback
        import grpc

        if not isinstance(err, grpc.RpcError) or not hasattr(err, "code"):
            raise
        server = getattr(args, "server", None)
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            print(f"error: --server {server}: no Eyas server answers there ({err.details()})", file=sys.stderr)
        else:
            print(f"error: --server {server}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eyas")
    except PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
