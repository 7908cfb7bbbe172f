"""The prepared device check: one short run that says what Eyas does on a device, in one summary.

On the default target (or, with --tiny, a tiny random Llama: the CPU test runs that), at --dtype
(bfloat16 by default) on --device (cuda when there is one, else cpu):

1. load      the target (and the shipped EAGLE-3 drafter; random ones with --tiny) onto the device;
2. identity  greedy EAGLE-3 speculative output against greedy target-only, at that device and dtype,
             on --prompts MT-bench first turns (counted, not asserted: bf16 need not be exact);
3. speed     tok/s of Eyas target-only and Eyas EAGLE-3 at batch 1, Eyas target-only at batch 16
             (one batched forward a round), and HF transformers' `generate` at batch 1 and 16,
             as ratios against Eyas target-only at batch 1 in the same run;
4. curve     the verify latency curve (ms of a verify of R rows after a 128-token context).

Every section runs on its own: one that fails is reported with its error and the others go on, so
a first run on a new device says what works and what does not.

5. training  the target extracts training features on the device and an EAGLE-3 drafter trains
             there under --dtype autocast: tokens/s with a step's samples packed into one token
             grid, against one sample at a time.

Run (about 8 minutes at most on one H200; seconds at --tiny on a CPU):
    .venv/bin/python bench/gpu_check.py                       # the default target, cuda, bfloat16
    .venv/bin/python bench/gpu_check.py --device cpu --dtype float32 --tiny
Writes bench/results/gpu_check.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def tiny_target(dtype: torch.dtype, device: str):
    """A random tiny HF Llama (transformers' own config class) and ours built from its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.config import TargetConfig
    from eyas.target.model import TargetModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(cfg).eval()
    ours = TargetModel(TargetConfig.from_hf(hf.config))
    ours.load_hf_state_dict(hf.state_dict())
    return hf.to(device=device, dtype=dtype), ours.to(device=device, dtype=dtype).eval()


def timed(fn, *args, **kwargs):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def decode_batch(engine, prompts: list[list[int]], max_new_tokens: int) -> int:
    """Greedy target-only decoding of every prompt together, one batched forward a round
    (``TargetEngine.step``); -> tokens generated."""
    from eyas.protocol.tree import DraftTree
    from eyas.verification.accept import greedy_accept

    rids = [f"b{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        engine.open_session(rid, p, max_new_tokens, 1)
    try:
        pre, _ = engine.step(rids, [])
        from eyas.protocol.messages import AcceptDecision

        for rid, p, v in zip(rids, prompts, pre):
            engine.publish(
                rid, v.round, AcceptDecision(torch.arange(len(p)), torch.tensor(p[1:]), int(v.logits[-1].argmax()))
            )
        tokens = len(rids)
        for _ in range(max_new_tokens - 1):
            _, out = engine.step([], [(rid, DraftTree.empty()) for rid in rids])
            for rid, v in zip(rids, out):
                engine.publish(rid, v.round, greedy_accept(v.flat, v.logits))
            tokens += len(rids)
        return tokens
    finally:
        for rid in rids:
            engine.close_session(rid)


def hf_generate(hf, prompts: list[list[int]], max_new_tokens: int, device: str) -> int:
    """HF transformers' greedy ``generate`` over the prompts as one left-padded batch; -> tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return (out.shape[1] - width) * len(prompts)


def train_rate(device: str, dtype: str, tiny: bool, steps: int, batch_samples: int = 8) -> dict:
    """Drafter training on the device: the frozen target extracts the features of ``batch_samples
    x (steps + 1)`` samples there (the target's own answers in data/regen; random token walks at
    --tiny), then EAGLE-3 trains ``steps`` optimizer steps after a warm-up one, the samples of a
    step packed into one token grid, and again one sample at a time; -> tokens/s of each."""
    import tempfile

    from eyas.training.config import TrainConfig
    from eyas.training.data import Sample
    from eyas.training.features import FeatureCache, training_taps
    from eyas.training.trainer import DrafterTrainer

    n = batch_samples * (steps + 1)
    if tiny:
        _, model = tiny_target(torch.float32, device)
        g = torch.Generator().manual_seed(2)
        samples = []
        for i in range(n):
            length = int(torch.randint(24, 64, (1,), generator=g))
            ids = (int(torch.randint(0, 256, (1,), generator=g)) + 3 * torch.arange(length)) % 256
            mask = torch.arange(length) >= length // 3
            samples.append(Sample(f"s{i}", ids, mask, torch.zeros(length, dtype=torch.int64), torch.arange(length)))
    else:
        from eyas.target.loader import load_target
        from eyas.training.data import render
        from eyas.training.regen import read_regenerated

        loaded = load_target(device=device)  # float32 weights: the trainer's autocast takes --dtype
        model = loaded.model
        answers = Path(__file__).resolve().parents[1] / "data" / "regen" / "smollm2-135m-sharegpt-train.answers.jsonl"
        samples = [
            x
            for rec in read_regenerated(answers)[:n]
            if (x := render(loaded.tokenizer, rec["id"], rec["messages"], 512)) is not None
        ]
    fingerprint = {"config_digest": "gpu-check", "weight_digest": "gpu-check", "tokenizer_digest": "gpu-check"}
    model.requires_grad_(False)
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = FeatureCache(Path(tmp) / "features")
        (_, t_extract) = timed(cache.extract, model, fingerprint, samples, training_taps(model), {"gpu_check": True})
        for name, pack in (("packed", 4096), ("one_by_one", None)):
            cfg = TrainConfig(
                method="eagle3",
                batch_samples=batch_samples,
                epochs=1.0,
                warmup_steps=1,
                draft_vocab_size=min(1024, model.cfg.vocab_size),
                eval_every=10**6,
                checkpoint_every=10**6,
                device=device,
                dtype=dtype,
                pack_tokens=pack,
                out=str(Path(tmp) / name),
            )
            trainer = DrafterTrainer(cfg, model, fingerprint, cache, cache)
            trainer.train_step()  # warm-up
            tokens = sum(
                trainer.train_data[i].input_ids.numel() for k in range(1, steps + 1) for i in trainer.batch_indices(k)
            )
            _, seconds = timed(lambda trainer=trainer: [trainer.train_step() for _ in range(steps)])
            rates[name] = tokens / seconds
    extracted = sum(x.input_ids.numel() for x in samples)
    return {
        "tokens_s": {k: round(v, 1) for k, v in rates.items()},
        "packed_vs_one_by_one": round(rates["packed"] / rates["one_by_one"], 2),
        "feature_extraction_tokens_s": round(extracted / t_extract, 1),
        "samples": len(samples),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama and random drafters (the CPU test)")
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench first turns for identity and speed")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=str(RESULTS / "gpu_check.json"))
    args = ap.parse_args(argv)
    from eyas.drafting.engine import TreeSpec
    from eyas.generate import generate
    from eyas.target.engine import TargetEngine
    from eyas.target.loader import check_dtype

    dtype = check_dtype(args.dtype)
    report: dict = {
        "device": args.device,
        "dtype": args.dtype,
        "tiny": args.tiny,
        "machine": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "sections": {},
    }
    state: dict = {}

    def section(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            result = fn()
            report["sections"][name] = {"ok": True, "s": round(time.perf_counter() - t0, 2), **(result or {})}
        except Exception as err:  # noqa: BLE001 - reported, and the other sections go on
            report["sections"][name] = {
                "ok": False,
                "s": round(time.perf_counter() - t0, 2),
                "error": f"{type(err).__name__}: {err}",
                "where": traceback.format_exc(limit=-3).splitlines()[-4:],
            }
        line = report["sections"][name]
        print(f"[{name}] {'ok' if line['ok'] else 'FAILED: ' + line['error']} ({line['s']} s)", flush=True)

    def load():
        from eyas.drafting.engine import DrafterEngine
        from eyas.drafting.model import DrafterConfig, drafter_feature_address, init_drafter

        if args.tiny:
            hf, model = tiny_target(dtype, args.device)
            g = torch.Generator().manual_seed(1)
            prompts = [
                torch.randint(1, 256, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
                for _ in range(max(args.prompts, 16))
            ]
            dcfg = DrafterConfig.for_target("eagle3", model.cfg)
            drafter = init_drafter(dcfg).to(device=args.device, dtype=dtype)
            taps = drafter_feature_address(dcfg, model.cfg)
            engine = DrafterEngine(drafter, model.embed, model.lm_head, taps=taps)
            tree = TreeSpec()
        else:
            from transformers import AutoModelForCausalLM

            from eyas.runtime import Eyas
            from eyas.target.loader import checkpoint_folder, load_target
            from eyas.training.data import mtbench_questions

            eyas = Eyas(loaded=load_target(device=args.device, dtype=args.dtype))
            model = eyas.model
            handle = eyas.drafter("eagle3")
            handle.engine.drafter.to(args.device)
            engine, taps, tree = handle.engine, handle.taps, handle.default_tree
            questions = [q["turns"][0] for q in mtbench_questions()]
            prompts = [eyas.encode(q) for q in questions[: max(args.prompts, 16)]]
            hf = AutoModelForCausalLM.from_pretrained(checkpoint_folder(), torch_dtype=dtype).to(args.device).eval()
        state.update(model=model, hf=hf, drafter=engine, taps=taps, tree=tree, prompts=prompts)
        return {
            "target_params": sum(p.numel() for p in model.parameters()),
            "tree": [tree.expand_width, tree.max_depth, tree.verify_budget],
        }

    def identity():
        model, prompts = state["model"], state["prompts"][: args.prompts]
        same, rounds_spec, rounds_base = 0, 0, 0
        for p in prompts:
            base = generate(TargetEngine(model, ()), p, max_new_tokens=args.max_new_tokens, stop_ids=())
            spec = generate(
                TargetEngine(model, state["taps"]),
                p,
                max_new_tokens=args.max_new_tokens,
                stop_ids=(),
                drafter=state["drafter"],
                tree=state["tree"],
            )
            same += spec.token_ids == base.token_ids
            rounds_spec, rounds_base = rounds_spec + len(spec.rounds), rounds_base + len(base.rounds)
        return {
            "identical": same,
            "prompts": len(prompts),
            "tau": args.max_new_tokens * len(prompts) / max(rounds_spec, 1),
        }

    def speed():
        model, hf, prompts = state["model"], state["hf"], state["prompts"]
        n = args.max_new_tokens
        one = prompts[0]
        generate(TargetEngine(model, ()), one, max_new_tokens=4, stop_ids=())  # warm-up
        _, t_base = timed(generate, TargetEngine(model, ()), one, max_new_tokens=n, stop_ids=())
        _, t_spec = timed(
            generate,
            TargetEngine(model, state["taps"]),
            one,
            max_new_tokens=n,
            stop_ids=(),
            drafter=state["drafter"],
            tree=state["tree"],
        )
        tokens16, t_b16 = timed(decode_batch, TargetEngine(model, ()), prompts[:16], n)
        hf_generate(hf, [one], 4, args.device)  # warm-up
        tok_hf1, t_hf1 = timed(hf_generate, hf, [one], n, args.device)
        tok_hf16, t_hf16 = timed(hf_generate, hf, prompts[:16], n, args.device)
        rates = {
            "eyas_target_only_b1": n / t_base,
            "eyas_eagle3_b1": n / t_spec,
            "eyas_target_only_b16": tokens16 / t_b16,
            "hf_generate_b1": tok_hf1 / t_hf1,
            "hf_generate_b16": tok_hf16 / t_hf16,
        }
        base = rates["eyas_target_only_b1"]
        return {
            "tok_s": {k: round(v, 1) for k, v in rates.items()},
            "vs_eyas_target_only_b1": {k: round(v / base, 2) for k, v in rates.items()},
        }

    def curve():
        from eyas.actors.target_worker import TargetWorker

        ms = TargetWorker(state["model"]).measure_latency((1, 2, 4, 8, 16, 32, 64), repeats=3, prefix=128)
        return {"verify_ms": {str(r): round(v, 2) for r, v in ms.items()}}

    def training():
        return train_rate(args.device, args.dtype, args.tiny, steps=2 if args.tiny else 4)

    section("load", load)
    for name, fn in (("identity", identity), ("speed", speed), ("curve", curve)):
        if report["sections"]["load"]["ok"]:
            section(name, fn)
    section("training", training)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    s = report["sections"]
    ok = [k for k, v in s.items() if v["ok"]]
    print(
        f"\nsummary ({args.device}, {args.dtype}{', tiny' if args.tiny else ''}): sections ok {ok}, "
        f"failed {[k for k in s if k not in ok]}"
        + (
            f"; identical {s['identity']['identical']}/{s['identity']['prompts']}, tau {s['identity']['tau']:.2f}"
            if s.get("identity", {}).get("ok")
            else ""
        )
        + (f"; tok/s {s['speed']['tok_s']}" if s.get("speed", {}).get("ok") else "")
        + (f"; training tok/s {s['training']['tokens_s']}" if s.get("training", {}).get("ok") else "")
        + f"; wrote {out}"
    )
    return 0 if all(v["ok"] for v in s.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
