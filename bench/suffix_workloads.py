"""Workloads where an answer repeats text it has seen (issue #54's), written as ``{"prompt": ...}`` .jsonl
files that ``bench/acceptance.py --prompts FILE --suffix`` reads:

- ``code_edit.jsonl``: a Python function from a package installed from a wheel (pyyaml, tqdm,
  msgpack's fallback, ...) and an instruction to change it, asking for the whole changed function;
  the answer copies most of the code it edits.
- ``document.jsonl``: a long assistant answer from ShareGPT's held-out split (never trained on) as
  a passage, and a question answered from it, asking to quote it.
- ``asked_again.jsonl``: MT-bench first turns, then the same questions asked again by other users in
  other words (a request prefix), for ``--shared-suffix``: a later answer may copy an earlier one.
- ``multi_turn.jsonl``: ShareGPT's held-out conversations (never trained on) up to their second user
  turn, as ``{"messages": [...]}``: the answer to the follow-up may repeat the first answer's names,
  code and phrases.

Both are deterministic (a seed picks the functions and passages).

    .venv/bin/python bench/suffix_workloads.py --out bench/out --limit 24
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# modules that ship in the project's dependency wheels (pure Python sources)
CODE_MODULES = ("yaml.constructor", "yaml.scanner", "tqdm.std", "tqdm.utils", "filelock._api", "pydantic.fields")
EDITS = (
    "Rename the variable `{name}` to `{name}_value` everywhere in it.",
    "Add a docstring line at the top of its body and keep everything else as it is.",
    "Add type hints where they are missing and keep the body unchanged.",
)
QUESTIONS = (
    "Quote the first two sentences of the text above exactly.",
    "Copy the paragraph of the text above that gives the most detail, word for word.",
    "Repeat the text above, then add one sentence that summarises it.",
)


def functions(limit: int, rng: random.Random) -> list[tuple[str, str]]:
    """(source, a local variable name) of functions of 6-40 lines from CODE_MODULES."""
    found = []
    for name in CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in inspect.getmembers(module):
            for fn in [obj] + (
                [m for _, m in inspect.getmembers(obj, inspect.isfunction)] if inspect.isclass(obj) else []
            ):
                if not inspect.isfunction(fn) or getattr(fn, "__module__", "") != name:
                    continue
                try:
                    src = inspect.getsource(fn)
                except (OSError, TypeError):
                    continue
                lines = src.count("\n")
                if not 6 <= lines <= 40:
                    continue
                tree = ast.parse(src.strip() if not src.startswith((" ", "\t")) else _dedent(src))
                names = sorted(
                    {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                )
                if names:
                    found.append((_dedent(src), names[0]))
    rng.shuffle(found)
    return found[:limit]


def _dedent(src: str) -> str:
    import textwrap

    return textwrap.dedent(src)


def code_edit(limit: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i, (src, name) in enumerate(functions(limit, rng)):
        edit = EDITS[i % len(EDITS)].format(name=name)
        out.append(
            {"prompt": f"Here is a Python function:\n\n```python\n{src}```\n\n{edit} Reply with the whole function."}
        )
    return out


def document(limit: int, seed: int) -> list[dict]:
    from eyas.training.data import conversations

    rng = random.Random(seed)
    passages = []
    for _, msgs in conversations("heldout", limit=2000):
        for m in msgs:
            text = m["content"] if m["role"] == "assistant" else ""
            if 600 <= len(text) <= 1800 and text.isascii():
                passages.append(text)
                break
    rng.shuffle(passages)
    return [{"prompt": f"{text}\n\n{QUESTIONS[i % len(QUESTIONS)]}"} for i, text in enumerate(passages[:limit])]


AGAIN = ("Please answer this: ", "A question from a colleague: ", "I was wondering: ")


def asked_again(limit: int, seed: int) -> list[dict]:
    from eyas.training.data import mtbench_questions

    rng = random.Random(seed)
    questions = [q["turns"][0] for q in mtbench_questions()]
    rng.shuffle(questions)
    first = questions[: limit // 2]
    return [{"prompt": q} for q in first] + [{"prompt": AGAIN[i % len(AGAIN)] + q} for i, q in enumerate(first)]


def multi_turn(limit: int, seed: int) -> list[dict]:
    from eyas.training.data import conversations

    rng = random.Random(seed)
    found = []
    for _, msgs in conversations("heldout", limit=4000, min_turns=3):
        first, answer, follow = msgs[0], msgs[1], msgs[2]
        if (
            answer["role"] == "assistant"
            and follow["role"] == "user"
            and 200 <= len(answer["content"]) <= 2000
            and len(first["content"]) + len(follow["content"]) <= 1200
            and (first["content"] + answer["content"] + follow["content"]).isascii()
        ):
            found.append({"messages": [first, answer, follow]})
    rng.shuffle(found)
    return found[:limit]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--seed", type=int, default=54)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets = (
        ("code_edit", code_edit(args.limit, args.seed)),
        ("document", document(args.limit, args.seed)),
        ("asked_again", asked_again(args.limit, args.seed)),
        ("multi_turn", multi_turn(args.limit, args.seed)),
    )
    for name, rows in sets:
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
