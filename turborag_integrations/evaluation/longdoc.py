"""A seeded generator and loader of long-document questions (the RAPID evaluation's data).

Each document is a gazetteer of an invented region, 6–8K tokens long: a paragraph per town,
person and company (their facts among filler sentences), a section of nicknames, and pages of
local history in between. Every name, year and fact is made up, so no model can answer from
memory. Each document carries four questions, of three kinds:

- direct (two per document): one fact of an entity named as the document names it ("Who founded
  Orbis Kilnworks?"). Retrieval by the question finds the entity's paragraph.
- alias: the question names the entity by a nickname that only the nicknames section defines
  ("Who founded the Copper Lantern?"); the fact is stated under the real name in another part of
  the document, so the passage that retrieval finds by the nickname does not hold the answer.
- two-hop: the answer needs two paragraphs ("Who is the mayor of the town where Orbis Kilnworks
  has its headquarters?"): the company's, which names the town, and the town's, which names its
  mayor but not the company.

Alias and two-hop questions are the ones where plain retrieval is likely to miss the key passage.
Each question lists its evidence sentences, so an evaluation can tell whether retrieval found
them. One JSON line per document:

    {"doc_id", "split": "dev" | "test", "seed", "tokens", "document",
     "questions": [{"id", "question", "answers": [...], "kind", "evidence": [sentences]}]}

Documents are split by document: dev (choose settings such as RAPID's η) and test (report only).

    python -m turborag_integrations.evaluation.longdoc --out turborag_integrations/data/longdoc
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .devset import FILLER, Entity, build_world
from .jsonl import read_jsonl

# Token bounds for a document, counted with the bundled model's tokenizer (SmolLM2, window 8192):
# room is left for the system prompt, the question and the answer.
MIN_TOKENS, MAX_TOKENS = 6000, 7600

ADJECTIVES = ["Copper", "Grey", "Salt", "Crooked", "Silent", "Amber", "Iron", "Velvet", "Hollow",
              "Lantern", "Cinder", "Frost", "Willow", "Brass", "Ember", "Moss", "Thorn", "Pale"]
NOUNS = ["Lantern", "Anchor", "Kettle", "Fox", "Bell", "Crown", "Wheel", "Gate", "Owl", "Harp",
         "Mill", "Barrel", "Sparrow", "Spindle", "Compass", "Hive", "Ladder", "Drum"]
HISTORY = FILLER + [
    "In the dry years the region traded more with the coast than with the capital.",
    "A survey of the roads was ordered after two bridges collapsed in the same spring.",
    "Travellers complained about the tolls on the northern pass for decades.",
    "The first printed map of the valley contained several invented villages.",
    "Every autumn the fairs draw merchants from three neighbouring provinces.",
    "Most houses were built of timber until a fire changed the building rules.",
    "The old customs house now serves as a school and a public library.",
    "Records from the period are incomplete because many ledgers were lost at sea.",
    "Shepherds still use the high pastures in the summer months.",
    "A narrow-gauge railway once connected the quarries with the river port.",
    "The regional council meets twice a year, alternating between the larger towns.",
    "Many families keep the recipes of the harvest festival to themselves.",
    "Fishing declined after the lakes were dammed for the mills.",
    "An early telegraph line followed the valley road for most of its length.",
    "Local choirs compete every spring in a contest that dates back generations.",
    "Storms in the winter months often cut the valley off for days at a time.",
    "The regional dialect borrows many words from the sailors of the coast.",
    "Scholars from the capital catalogued the churches and their bells.",
]


@dataclass
class Question:
    id: str
    question: str
    answers: list[str]
    kind: str  # direct | alias | two-hop
    evidence: list[str] = field(default_factory=list)


@dataclass
class LongDocument:
    doc_id: str
    split: str
    document: str
    questions: list[Question]
    tokens: int = 0
    seed: int | None = None
    line: int = 0


# ---- generation ------------------------------------------------------------------------------

def _sentences(e: Entity) -> dict[str, str]:
    """The fact sentences of an entity, by fact (the devset's wording)."""
    f = e.facts
    if e.kind == "town":
        return {"founded": f"The town of {e.name} was founded in {f['founded']}.",
                "mayor": f"The current mayor of {e.name} is {f['mayor']}.",
                "export": f"{e.name} is best known for its export of {f['export']}.",
                "river": f"The river {f['river']} runs through the middle of {e.name}."}
    if e.kind == "person":
        return {"profession": f"{e.name} works as a {f['profession']}.",
                "hometown": f"{e.name} grew up in the town of {f['hometown']}.",
                "pet": f"{e.name} keeps a {f['pet']} named {f['pet_name']}."}
    return {"founded": f"{e.name} was established in {f['founded']}.",
            "hq": f"{e.name} has its headquarters in the town of {f['hq']}.",
            "product": f"{e.name} manufactures {f['product']}.",
            "founder": f"{e.name} was founded by {f['founder']}."}


def _paragraph(rng: random.Random, e: Entity, filler: int) -> str:
    sentences = list(_sentences(e).values()) + rng.sample(HISTORY, k=filler)
    rng.shuffle(sentences)
    return " ".join(sentences)


# Questions whose answer is an invented name or a year: not guessable from a short list.
def _direct(e: Entity) -> list[tuple[str, str, str]]:
    """(question, answer, fact) for one entity, named as the document names it."""
    f = e.facts
    if e.kind == "town":
        return [(f"In what year was the town of {e.name} founded?", f["founded"], "founded"),
                (f"Who is the mayor of {e.name}?", f["mayor"], "mayor"),
                (f"Which river runs through {e.name}?", f["river"], "river")]
    if e.kind == "person":
        return [(f"What is the name of {e.name}'s {f['pet']}?", f["pet_name"], "pet"),
                (f"In which town did {e.name} grow up?", f["hometown"], "hometown")]
    return [(f"In what year was {e.name} established?", f["founded"], "founded"),
            (f"Who founded {e.name}?", f["founder"], "founder"),
            (f"In which town does {e.name} have its headquarters?", f["hq"], "hq")]


def _by_alias(e: Entity, alias: str) -> list[tuple[str, str, str]]:
    f = e.facts
    if e.kind == "company":
        return [(f"Who founded the company nicknamed {alias}?", f["founder"], "founder"),
                (f"In what year was the company nicknamed {alias} established?", f["founded"],
                 "founded")]
    return [(f"Who is the mayor of the town nicknamed {alias}?", f["mayor"], "mayor"),
            (f"Which river runs through the town nicknamed {alias}?", f["river"], "river")]


def make_document(seed: int, doc_id: str, split: str, count_tokens: Callable[[str], int], *,
                  questions: int = 4) -> dict:
    """One document and its questions: 2 direct, 1 alias, 1 two-hop (then direct for more)."""
    world = build_world(seed, towns=10, people=12, companies=10)
    rng = random.Random(seed + 1)
    entities = world["town"] + world["person"] + world["company"]
    by_name = {e.name: e for e in entities}
    rng.shuffle(entities)
    # Nicknames for two towns and two companies; one of them is asked about.
    aliased = rng.sample(world["town"], 2) + rng.sample(world["company"], 2)
    alias = {}
    for e in aliased:
        while True:
            a = f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
            if a.split()[1] != a.split()[2] and a not in alias.values():
                alias[e.name] = a
                break
    nick_lines = [f"Among the people of the valley, {n} is known simply as {a}."
                  for n, a in alias.items()]
    nicknames = ("Local names. " + " ".join(nick_lines) + " "
                 + " ".join(rng.sample(HISTORY, 3)))
    # Questions first (they fix which entities must be far apart from their aliases).
    qs: list[Question] = []
    direct_pool = [e for e in entities if e not in aliased]
    picked = rng.sample(direct_pool, max(2, questions - 2))
    for e in picked[:2]:
        q, a, fact = rng.choice(_direct(e))
        qs.append(Question("", q, [a], "direct", [_sentences(e)[fact]]))
    target = rng.choice(aliased)
    q, a, fact = rng.choice(_by_alias(target, alias[target.name]))
    qs.append(Question("", q, [a], "alias",
                       [f"Among the people of the valley, {target.name} is known simply as "
                        f"{alias[target.name]}.", _sentences(target)[fact]]))
    company = rng.choice([c for c in world["company"] if c not in picked])
    town = by_name[company.facts["hq"]]
    q, a, fact = rng.choice([
        (f"Who is the mayor of the town where {company.name} has its headquarters?",
         town.facts["mayor"], "mayor"),
        (f"In what year was the town where {company.name} has its headquarters founded?",
         town.facts["founded"], "founded")])
    qs.append(Question("", q, [a], "two-hop", [_sentences(company)["hq"], _sentences(town)[fact]]))
    for e in picked[2:questions - 2]:
        q, a, fact = rng.choice(_direct(e))
        qs.append(Question("", q, [a], "direct", [_sentences(e)[fact]]))
    for i, question in enumerate(qs):
        question.id = f"{doc_id}-q{i}"
    # Paragraphs: entities in shuffled order, history pages between them; the nicknames section
    # goes at the start or the end, so it is far from most entity paragraphs.
    paragraphs = [_paragraph(rng, e, filler=3) for e in entities]
    history = lambda: " ".join(rng.sample(HISTORY, 6))  # noqa: E731
    body = [nicknames] + paragraphs if rng.random() < 0.5 else paragraphs + [nicknames]
    title = f"A gazetteer of the {rng.choice(ADJECTIVES)} valley"
    # Grow with history pages at random places until the document is long enough.
    text = lambda parts: title + "\n\n" + "\n\n".join(parts)  # noqa: E731
    while count_tokens(text(body)) < MIN_TOKENS + 600:
        body.insert(rng.randrange(1, len(body)), history())
    tokens = count_tokens(text(body))
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ValueError(f"document {doc_id} came out at {tokens} tokens, outside "
                         f"[{MIN_TOKENS}, {MAX_TOKENS}]: change the seed or the sizes")
    document = text(body)
    for question in qs:
        for sentence in question.evidence:
            assert sentence in document, (doc_id, sentence)
    return {"doc_id": doc_id, "split": split, "seed": seed, "tokens": tokens,
            "document": document,
            "questions": [{"id": q.id, "question": q.question, "answers": q.answers,
                           "kind": q.kind, "evidence": q.evidence} for q in qs]}


def generate(out: Path, count_tokens: Callable[[str], int], *, seed: int = 1701, dev: int = 4,
             test: int = 6, questions: int = 4) -> dict[str, Path]:
    """dev.jsonl and test.jsonl under `out`: different documents (and worlds) in each."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, n, base in (("dev", dev, seed), ("test", test, seed + 5000)):
        path = out / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                doc = make_document(base + 97 * i, f"{split}{i:02d}", split, count_tokens,
                                    questions=questions)
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        files[split] = path
    return files


# ---- loading ---------------------------------------------------------------------------------

def load_documents(path: str | Path) -> tuple[list[LongDocument], list[tuple[int, str]]]:
    """Read a long-document set; malformed lines come back as (line number, reason)."""
    return read_jsonl(path, _document)


def _document(d: dict, n: int) -> LongDocument:
    text = d.get("document")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("'document' must be a non-empty string (the long context)")
    raw = d.get("questions")
    if not isinstance(raw, list) or not raw:
        raise ValueError("'questions' must be a non-empty list")
    qs = []
    for j, q in enumerate(raw):
        if not isinstance(q, dict) or not isinstance(q.get("question"), str) \
                or not q["question"].strip():
            raise ValueError(f"question {j}: needs a non-empty 'question' string")
        answers = q.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers \
                or not all(isinstance(a, str) and a.strip() for a in answers):
            raise ValueError(f"question {j}: 'answers' must be a non-empty list of strings")
        qs.append(Question(str(q.get("id", f"line{n}-q{j}")), q["question"], answers,
                           str(q.get("kind", "direct")), list(q.get("evidence") or [])))
    return LongDocument(str(d.get("doc_id", f"line{n}")), str(d.get("split", "")), text, qs,
                        int(d.get("tokens") or 0), d.get("seed"), n)


def is_long_document_set(path: str | Path) -> bool:
    """True when the first non-empty line of a JSONL file is a document (has "document")."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(d, dict) and "document" in d
    return False


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "data" / "longdoc")
    ap.add_argument("--seed", type=int, default=1701)
    ap.add_argument("--dev", type=int, default=4)
    ap.add_argument("--test", type=int, default=6)
    ap.add_argument("--model", default=None, help="the bundled model whose tokenizer counts the "
                    "tokens (default: SmolLM2, the smallest window)")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from ..core.bundled import prepare_bundled
    from ..core.models import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(str(prepare_bundled(a.model or DEFAULT_MODEL)))
    count = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    for name, path in generate(a.out, count, seed=a.seed, dev=a.dev, test=a.test).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
