"""A broad, seeded training mix for the learned chunk encoder (distill.py).

The devset's train split teaches one prompt layout, a fixed number of chunks, and questions that
always have an answer. Deployed, the model meets the prompts of LlamaIndex, LangChain and plain
chat pipelines (templates.py), one retrieved chunk or ten, and retrievals that miss the fact; a
chunk encoder never trained on those leaves it answering from the wrong chunk instead of saying
it cannot. So this mix holds:

  * every template of templates.TEMPLATES, roughly uniformly, the evaluation prompt a bit more;
  * 1 to 10 chunks per item (single-chunk items included), the distractors first of the gold
    entities' kinds, so they state the same kinds of facts;
  * one- and two-hop questions;
  * about 15% unanswerable items: an item whose gold chunk is dropped (for two hops, the chunk
    stating the answer, and half the time the bridge chunk too), so the fact is absent; their
    answer is REFUSAL.

The facts come from devset.py's fictional worlds, built from seeds of their own, none of them a
test world's seed, so training on the mix cannot leak test facts.

Each JSONL line: {"id", "template", "question", "answers", "chunks", "gold", "hops",
"unanswerable"}; `target_reply` is the reply the model is trained to give.

    python -m turborag_integrations.training.mix --out mix.jsonl --n 1200 --seed 7
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..evaluation.devset import Entity, _questions, build_world, write_jsonl
from .templates import REFUSAL, TEMPLATES

__all__ = ["REFUSAL", "generate_mix", "retemplate", "target_reply", "template_plan",
           "world_seeds"]

EVAL_WEIGHT = 1.5  # the evaluation prompt, relative to each other template
UNANSWERABLE_RATE = 0.15
MAX_CHUNKS = 10
ITEMS_PER_WORLD = 200  # several worlds: more names, towns and companies than one world holds
FILLERS = (1, 2, 3, 4, 6)  # filler sentences per paragraph (chunk length), drawn per world
# devset.generate_devset(seed=7) builds its test and test_long worlds from these seeds.
TEST_SEEDS = frozenset({1007, 2007})
WORLD_SEED_BASE = 500_000


def world_seeds(seed: int) -> Iterator[int]:
    """The mix's world seeds for `seed`: far from the devset's, never a test world's."""
    for i in itertools.count():
        s = WORLD_SEED_BASE + 1000 * seed + i
        if s not in TEST_SEEDS:
            yield s


def template_plan(n: int, rng: random.Random) -> list[str]:
    """n template names in proportion to their weights (largest remainders), shuffled."""
    weights = {name: EVAL_WEIGHT if name == "eval" else 1.0 for name in TEMPLATES}
    total = sum(weights.values())
    exact = {name: n * w / total for name, w in weights.items()}
    counts = {name: int(x) for name, x in exact.items()}
    by_remainder = sorted(exact, key=lambda name: exact[name] - counts[name], reverse=True)
    for name in by_remainder[:n - sum(counts.values())]:
        counts[name] += 1
    plan = [name for name, c in counts.items() for _ in range(c)]
    rng.shuffle(plan)
    return plan


def _distractors(every: Sequence[Entity], exclude: Sequence[Entity], k: int,
                 rng: random.Random) -> list[Entity]:
    """k entities not in `exclude`: first of the excluded entities' kinds, then any."""
    kinds = {e.kind for e in exclude}
    same = [e for e in every if e.kind in kinds and e not in exclude]
    others = [e for e in every if e.kind not in kinds and e not in exclude]
    pick = rng.sample(same, min(k, len(same)))
    return pick + rng.sample(others, k - len(pick))


def _dropped(gold: Sequence[Entity], rng: random.Random) -> list[Entity]:
    """The gold entities an unanswerable item keeps: the last one states the answer and goes;
    a two-hop item's bridge (the first) goes too half the time."""
    kept = list(gold[:-1])
    if kept and rng.random() < 0.5:
        kept = []
    return kept


def make_item(question: str, answer: str, gold: Sequence[Entity], hops: int,
              every: Sequence[Entity], rng: random.Random, *, unanswerable: bool) -> dict:
    """One item: gold paragraph(s) (or, unanswerable, what is left of them) among distractors,
    1 to MAX_CHUNKS chunks in all, shuffled."""
    kept = _dropped(gold, rng) if unanswerable else list(gold)
    n_chunks = max(rng.randint(1, MAX_CHUNKS), len(kept))
    docs = kept + _distractors(every, gold, n_chunks - len(kept), rng)
    rng.shuffle(docs)
    return {"question": question,
            "answers": [REFUSAL] if unanswerable else [answer],
            "chunks": [d.text for d in docs],
            "gold": [] if unanswerable else sorted(docs.index(g) for g in gold),
            "hops": hops, "unanswerable": unanswerable}


def generate_mix(n: int, seed: int = 7) -> list[dict]:
    """n items over as many worlds as it takes (ITEMS_PER_WORLD each), templates assigned by
    `template_plan`, round(n * UNANSWERABLE_RATE) of them unanswerable."""
    rng = random.Random(seed)
    plan = template_plan(n, rng)
    unanswerable = set(rng.sample(range(n), round(n * UNANSWERABLE_RATE)))
    items: list[dict] = []
    seen: set[str] = set()
    for world_seed in world_seeds(seed):
        if len(items) >= n:
            break
        world = build_world(world_seed, filler=rng.choice(FILLERS))
        every = [e for kind in world.values() for e in kind]
        # Unique questions per world number in the hundreds; the cap ends a world that runs dry.
        questions = itertools.islice(_questions(world, random.Random(world_seed + 1)),
                                     ITEMS_PER_WORLD * 20)
        taken = 0
        for question, answer, gold, hops in questions:
            if len(items) >= n or taken >= ITEMS_PER_WORLD:
                break
            if question in seen:
                continue
            seen.add(question)
            i = len(items)
            item = make_item(question, answer, gold, hops, every, rng,
                             unanswerable=i in unanswerable)
            items.append({"id": f"mix{i:05d}", "template": plan[i], **item})
            taken += 1
    return items


def retemplate(items: list[dict], old: str, new: str) -> int:
    """Render the items of template `old` through template `new` instead, in place; the rest of
    the mix (facts, chunks, order, the other items' templates) stays as generated. Returns how
    many items moved.

    Why: the refine template's prompt always holds REFUSAL as the answer so far, and a model
    trained on it declines answerable questions in LlamaIndex's chat text-QA prompt, which shares
    its system message (docs/accuracy.md); moving those items to the text-QA template removes it."""
    for name in (old, new):
        if name not in TEMPLATES:
            raise ValueError(f"unknown template {name!r}; templates: {', '.join(TEMPLATES)}")
    moved = 0
    for item in items:
        if item["template"] == old:
            item["template"] = new
            moved += 1
    return moved


def _get(item: Any, name: str, default: Any = None) -> Any:
    return item.get(name, default) if isinstance(item, dict) else getattr(item, name, default)


def target_reply(item: Any, template_name: str) -> str:
    """The reply the model is trained to give: REFUSAL when the context lacks the fact; else the
    bare answer for the evaluation prompt (it asks for the answer alone), and one short sentence
    holding it for the other templates. `item` is a mix dict or an evaluation Item."""
    answers = _get(item, "answers") or [REFUSAL]
    if _get(item, "unanswerable", False) or answers[0] == REFUSAL:
        return REFUSAL
    if template_name == "eval":
        return answers[0]
    return f"The answer is {answers[0]}."


def summary(items: Sequence[dict]) -> dict[str, Counter]:
    return {"template": Counter(it["template"] for it in items),
            "chunks": Counter(len(it["chunks"]) for it in items),
            "hops": Counter(it["hops"] for it in items),
            "unanswerable": Counter(it["unanswerable"] for it in items)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    ap.add_argument("--n", type=int, default=1200, help="number of items")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--retemplate", action="append", default=[], metavar="FROM=TO",
                    help="render FROM's items through TO instead (repeatable), e.g. "
                         "llama_index_refine=llama_index_text_qa")
    a = ap.parse_args(argv)
    moves = []
    for spec in a.retemplate:
        old, sep, new = (part.strip() for part in spec.partition("="))
        if not sep:
            ap.error(f"--retemplate expects FROM=TO, got {spec!r}")
        try:
            retemplate([], old, new)  # checks both names before any item is generated
        except ValueError as exc:
            ap.error(f"--retemplate {spec!r}: {exc}")
        moves.append((old, new))
    items = generate_mix(a.n, a.seed)
    for old, new in moves:
        print(f"{retemplate(items, old, new)} items {old} -> {new}")
    write_jsonl(items, a.out)
    print(f"{len(items)} items -> {a.out}")
    counts = summary(items)
    print("per template:", dict(sorted(counts["template"].items())))
    print("per chunk count:", dict(sorted(counts["chunks"].items())))
    print("per hops:", dict(sorted(counts["hops"].items())))
    print("unanswerable:", counts["unanswerable"][True])


if __name__ == "__main__":
    main()
