"""The ``eyas`` command line.

    eyas generate --prompt TEXT [--method target|eagle1|eagle3] [--drafter PATH] [--max-new-tokens N]
                  [--temperature T] [--top-p P] [--top-k K] [--seed S] [--tree-kind dynamic|static|chain]
                  [--tree-depth D --tree-width W --tree-budget B] [--precision fp32|int8] [--raw] [--json]
    eyas demo [--prompt TEXT]     speculative vs target-only on the default model, with the speedup

Bad input exits with status 2 and one line ``error: <field>: <why>``.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="the user message (wrapped in the chat template unless --raw)")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--method", default="eagle3", help="target | eagle1 | eagle3 (default eagle3)")
    p.add_argument("--drafter", help="a drafter checkpoint folder (default: the one shipped for the method)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree-kind", default="dynamic", choices=["dynamic", "static", "chain"])
    p.add_argument("--tree-depth", type=int)
    p.add_argument("--tree-width", type=int)
    p.add_argument("--tree-budget", type=int)
    p.add_argument("--precision", default="fp32", help="served precision of the target: fp32 | int8")
    p.add_argument("--target", default="smollm2-135m", help="smollm2-135m, a .gguf file, or an HF checkpoint dir")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")


def _request(args, method: str | None = None):
    from eyas.protocol.schema import parse_request

    ids = None
    if args.prompt_ids:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError("prompt_ids: must be comma-separated integers") from None
    return parse_request(prompt=args.prompt, prompt_ids=ids, raw=args.raw, method=method or args.method,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         top_k=args.top_k, seed=args.seed, drafter=args.drafter, tree_kind=args.tree_kind,
                         tree_depth=args.tree_depth, tree_width=args.tree_width, tree_budget=args.tree_budget)


def cmd_generate(args) -> int:
    from eyas.runtime import Eyas, set_threads

    req = _request(args)  # validate before the (slow) model load
    set_threads(args.threads)
    eyas = Eyas(args.target, args.precision)
    _, report = eyas.generate(req)
    if args.json:
        print(json.dumps(report))
    else:
        print(report["text"])
        print(f"\n[{report['method']}] {report['new_tokens']} tokens in {report['wall_s']:.2f} s "
              f"({report['tokens_per_s']:.1f} tok/s), {report['target_forwards']} target forwards, "
              f"tau = {report['accept_length_mean']:.2f}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from eyas.runtime import Eyas, set_threads

    spec_req = _request(args)
    base_req = _request(args, method="target")
    set_threads(args.threads)
    print(f"loading the default target ({args.target}, {args.precision}) ...", flush=True)
    eyas = Eyas(args.target, args.precision)
    eyas.generate(base_req.model_copy(update={"max_new_tokens": 4}))  # warm-up
    _, base = eyas.generate(base_req)
    _, spec = eyas.generate(spec_req)
    print("\n" + spec["text"] + "\n")
    print(f"{'method':<10} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'tau':>5}")
    for r in (base, spec):
        print(f"{r['method']:<10} {r['new_tokens']:>6} {r['wall_s']:>7.2f} {r['tokens_per_s']:>7.1f} "
              f"{r['accept_length_mean']:>5.2f}")
    same = "identical" if base["token_ids"] == spec["token_ids"] else "DIFFERENT"
    print(f"speedup {spec['tokens_per_s'] / max(base['tokens_per_s'], 1e-9):.2f}x over target-only "
          f"(greedy outputs {same}; drafter: {spec['drafter']})")
    return 0


def cmd_train(args) -> int:
    from eyas.runtime import Eyas, set_threads
    from eyas.training.config import load_config
    from eyas.training.prepare import prepare_features
    from eyas.training.trainer import DrafterTrainer

    cfg = load_config(args.config)
    if args.method and args.method != cfg.method:
        cfg = cfg.model_copy(update={"method": args.method})
    if args.out:
        cfg = cfg.model_copy(update={"out": args.out})
    set_threads(cfg.threads)
    eyas = Eyas(cfg.target, "fp32")
    train, heldout = prepare_features(cfg, eyas)
    trainer = DrafterTrainer(cfg, eyas.model, eyas.loaded.fingerprint.to_dict(), train, heldout)
    summary = trainer.fit()
    path = trainer.export(summary)
    print(f"drafter written to {path} ({summary['steps']} steps, {summary['wall_s']} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eyas", description="EAGLE-family speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer")
    _add_generate_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="speculative vs target-only on the default model")
    _add_generate_flags(d)
    d.set_defaults(func=cmd_demo, prompt="Explain in three sentences why the sky is blue.")
    t = sub.add_parser("train", help="train a drafter for the target (EAGLE-1, HASS or EAGLE-3)")
    t.add_argument("--method", choices=["eagle1", "hass", "eagle3"], help="overrides the config's method")
    t.add_argument("--config", required=True, help="a training YAML (see configs/)")
    t.add_argument("--out", help="overrides the config's output folder")
    t.set_defaults(func=cmd_train)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
