"""A seeded generator of fictional RAG questions: documents, distractors, one- and two-hop questions.

Every fact is invented (made-up names, towns, companies, years), so a model cannot answer from
memory: it must read the right chunk. Each item is one JSON line:

    {"id", "question", "answers": [...], "chunks": [texts], "gold": [indices], "hops": 1 | 2}

A world holds towns, people and companies; each entity has one paragraph (a chunk) stating its
facts among filler sentences. A one-hop question asks a fact of one entity ("In what year was the
town of Velkaro founded?"); a two-hop question chains two ("Who is the mayor of the town where
Orbis Kilnworks has its headquarters?"), so its two gold chunks must be combined. Distractors are
paragraphs about other entities of the same kinds, with the same kinds of facts.

Train and test items come from different worlds (different seeds), so training on the train
split cannot memorise test facts.

    python -m turborag_integrations.evaluation.devset --out turborag_integrations/data/devset
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

SYLLABLES = ["ka", "ve", "lor", "mi", "tan", "sel", "dra", "qu", "bre", "nol", "shi", "var", "ete",
             "ru", "zan", "po", "fi", "gre", "ul", "th", "mar", "ost", "ye", "ix", "ber", "ona"]
GIVEN = ["Tamsin", "Orrin", "Maelis", "Joaquil", "Brisa", "Kestrel", "Idony", "Faro", "Linnea",
         "Perrin", "Solvei", "Dagny", "Emrys", "Calla", "Thessaly", "Ruan", "Ysolde", "Ivo",
         "Nerys", "Cassian", "Wrenna", "Baltus", "Odile", "Heddwyn"]
PROFESSIONS = ["glassblower", "cartographer", "beekeeper", "clockmaker", "ferry pilot",
               "astronomer", "rope maker", "violin builder", "salt merchant", "lamplighter",
               "botanist", "bookbinder"]
GOODS = ["blue slate", "dried figs", "copper wire", "felt hats", "amber resin", "river pearls",
         "walnut oil", "wool blankets", "tin whistles", "smoked eels", "lacquered boxes"]
PRODUCTS = ["weather balloons", "pocket looms", "clay stoves", "brass telescopes", "kite sails",
            "ice skates", "paper lanterns", "wind organs", "glass buoys", "copper kettles"]
ANIMALS = ["heron", "tortoise", "ferret", "goat", "parrot", "hound", "owl", "donkey"]
FILLER = [
    "Visitors often remark on how quiet the mornings are.",
    "Most of the local records were copied by hand in the last century.",
    "The nearest railway line passes a few kilometres to the east.",
    "Winters there are long, and the summers are short but bright.",
    "A small museum keeps letters, maps and old tools from the early years.",
    "Local newspapers rarely mention it outside the harvest season.",
    "Several travel guides describe the area as worth a detour.",
    "Historians disagree about many details of its early years.",
    "A weekly market is held on the square every Thursday.",
    "The surrounding hills are covered in pine and birch forest.",
    "Few outsiders knew much about it until a documentary was filmed there.",
    "Its archives were moved to a new building after a flood.",
]


def _name(rng: random.Random, parts=(2, 3)) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.choice(parts))).capitalize()


@dataclass
class Entity:
    kind: str  # town | person | company
    name: str
    facts: dict = field(default_factory=dict)
    text: str = ""


def build_world(seed: int, towns: int = 30, people: int = 40, companies: int = 30,
                filler: int = 3) -> dict[str, list[Entity]]:
    rng = random.Random(seed)
    used: set[str] = set()

    def unique(make):
        while True:
            n = make()
            if n not in used:
                used.add(n)
                return n

    T = [Entity("town", unique(lambda: _name(rng))) for _ in range(towns)]
    P = [Entity("person", unique(lambda: f"{rng.choice(GIVEN)} {_name(rng)}")) for _ in range(people)]
    C = [Entity("company", unique(lambda: f"{_name(rng)} {rng.choice(['Works', 'Company', 'Guild', 'Foundry', 'Cooperative'])}"))
         for _ in range(companies)]
    for t in T:
        t.facts = {"founded": str(rng.randint(1420, 1890)), "mayor": rng.choice(P).name,
                   "export": rng.choice(GOODS), "river": _name(rng, (2,))}
    for p in P:
        p.facts = {"profession": rng.choice(PROFESSIONS), "hometown": rng.choice(T).name,
                   "pet": rng.choice(ANIMALS), "pet_name": _name(rng, (2,))}
    for c in C:
        c.facts = {"founded": str(rng.randint(1801, 1999)), "hq": rng.choice(T).name,
                   "product": rng.choice(PRODUCTS), "founder": rng.choice(P).name}
    for e in T + P + C:
        e.text = _paragraph(rng, e, filler)
    return {"town": T, "person": P, "company": C}


def _paragraph(rng: random.Random, e: Entity, filler: int) -> str:
    f = e.facts
    if e.kind == "town":
        facts = [f"The town of {e.name} was founded in {f['founded']}.",
                 f"The current mayor of {e.name} is {f['mayor']}.",
                 f"{e.name} is best known for its export of {f['export']}.",
                 f"The river {f['river']} runs through the middle of {e.name}."]
    elif e.kind == "person":
        facts = [f"{e.name} works as a {f['profession']}.",
                 f"{e.name} grew up in the town of {f['hometown']}.",
                 f"{e.name} keeps a {f['pet']} named {f['pet_name']}."]
    else:
        facts = [f"{e.name} was established in {f['founded']}.",
                 f"{e.name} has its headquarters in the town of {f['hq']}.",
                 f"{e.name} manufactures {f['product']}.",
                 f"{e.name} was founded by {f['founder']}."]
    rng.shuffle(facts)
    sentences = facts + rng.sample(FILLER, k=min(filler, len(FILLER)))
    rng.shuffle(sentences)
    # Pad longer chunks (for the ≈4K-token timing set) with more filler, repeated if needed.
    while len(sentences) < len(facts) + filler:
        sentences.insert(rng.randrange(len(sentences) + 1), rng.choice(FILLER))
    return " ".join(sentences)


def _questions(world, rng: random.Random):
    """Yield (question, answer, gold entities, hops)."""
    T, P, C = world["town"], world["person"], world["company"]
    by_name = {e.name: e for k in world.values() for e in k}
    while True:
        kind = rng.random()
        if kind < 0.55:  # one hop
            e = rng.choice(T + P + C)
            f = e.facts
            opts = {
                "town": [(f"In what year was the town of {e.name} founded?", f.get("founded")),
                         (f"Who is the mayor of {e.name}?", f.get("mayor")),
                         (f"What is {e.name} best known for exporting?", f.get("export")),
                         (f"Which river runs through {e.name}?", f.get("river"))],
                "person": [(f"What does {e.name} work as?", f.get("profession")),
                           (f"In which town did {e.name} grow up?", f.get("hometown")),
                           (f"What is the name of {e.name}'s {f.get('pet')}?", f.get("pet_name"))],
                "company": [(f"In what year was {e.name} established?", f.get("founded")),
                            (f"In which town does {e.name} have its headquarters?", f.get("hq")),
                            (f"What does {e.name} manufacture?", f.get("product")),
                            (f"Who founded {e.name}?", f.get("founder"))],
            }[e.kind]
            q, a = rng.choice(opts)
            yield q, a, [e], 1
        else:  # two hops: company → town, or person → town
            if rng.random() < 0.6:
                c = rng.choice(C)
                t = by_name[c.facts["hq"]]
                q, a = rng.choice([
                    (f"Who is the mayor of the town where {c.name} has its headquarters?",
                     t.facts["mayor"]),
                    (f"In what year was the town where {c.name} has its headquarters founded?",
                     t.facts["founded"]),
                    (f"Which river runs through the town where {c.name} has its headquarters?",
                     t.facts["river"])])
                yield q, a, [c, t], 2
            else:
                p = rng.choice(P)
                t = by_name[p.facts["hometown"]]
                q, a = rng.choice([
                    (f"What is the town where {p.name} grew up best known for exporting?",
                     t.facts["export"]),
                    (f"Who is the mayor of the town where {p.name} grew up?", t.facts["mayor"])])
                yield q, a, [p, t], 2


def make_items(seed: int, n: int, *, chunks: int = 8, filler: int = 3, prefix: str = "q") -> list[dict]:
    """n items from one world: gold paragraph(s) plus distractors, shuffled, `chunks` in all."""
    world = build_world(seed, filler=filler)
    rng = random.Random(seed + 1)
    every = [e for k in world.values() for e in k]
    items, seen = [], set()
    for q, a, gold, hops in _questions(world, rng):
        if len(items) >= n:
            break
        if q in seen:
            continue
        seen.add(q)
        # Distractors: first the same kinds as the gold entities (same fact types), then any.
        same = [e for e in every if e.kind in {g.kind for g in gold} and e not in gold]
        others = [e for e in every if e not in gold and e not in same]
        k = chunks - len(gold)
        pick = rng.sample(same, min(k, len(same)))
        pick += rng.sample(others, k - len(pick))
        docs = list(gold) + pick
        rng.shuffle(docs)
        items.append({"id": f"{prefix}{len(items):04d}", "question": q, "answers": [a],
                      "chunks": [d.text for d in docs],
                      "gold": sorted(docs.index(g) for g in gold), "hops": hops})
    return items


def write_jsonl(items: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")


def generate_devset(out: Path, *, seed: int = 7, train: int = 300, test: int = 60,
                    long: int = 8) -> dict[str, Path]:
    """train.jsonl (6 short chunks), test.jsonl (8 short chunks, ≈1K tokens) and
    test_long.jsonl (8 chunks of ≈500 tokens: ≈4K-token prompts, for timing)."""
    out = Path(out)
    files = {"train": out / "train.jsonl", "test": out / "test.jsonl",
             "test_long": out / "test_long.jsonl"}
    write_jsonl(make_items(seed, train, chunks=6, prefix="train"), files["train"])
    write_jsonl(make_items(seed + 1000, test, chunks=8, prefix="test"), files["test"])
    write_jsonl(make_items(seed + 2000, long, chunks=8, filler=40, prefix="long"), files["test_long"])
    return files


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "devset")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--train", type=int, default=300)
    ap.add_argument("--test", type=int, default=60)
    ap.add_argument("--long", type=int, default=8)
    a = ap.parse_args(argv)
    for name, path in generate_devset(a.out, seed=a.seed, train=a.train, test=a.test,
                                      long=a.long).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
