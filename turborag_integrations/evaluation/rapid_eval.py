"""Long-document evaluation of RAPID: accuracy and decode speed of four ways to answer.

Modes (the `turborag eval` names):

- long-context: the target alone, the whole document in its context, greedy
- rag-only: the drafter alone, answering from the chunks retrieved for the question (exactly the
  chunks, prompt and stitched prefill that RAPID's drafter reads)
- rapid:η: RAPID with that η (greedy; η = 0 is lossless, so its answers must equal
  long-context's — the evaluation reports that agreement)
- rapid: RAPID with the η chosen on a dev set: every η of a grid is run on the dev documents and
  the most accurate wins (ties: the smaller η, the closer to lossless). The evaluated documents
  are never used for the choice, and may not overlap the dev documents.

Every mode reads the same retrieval per question (`RapidEngine.drafter_context`, computed once
and handed to RAPID as its chunks), the same prompt (`prompt.SYSTEM` and a "Context / Question"
user turn) and is scored the same way (`metrics.score`: a reply is correct when it contains an
answer). The document's prefill is encoded once per document as a prefix blob and reused by the
target across its questions and modes (RAPID's prefix cache reads the same blob). A question also
records whether retrieval found its evidence: all of its evidence sentences occur whole in the
drafter's chunks.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..core.errors import ContextWindowError
from ..core.prefill.stitch import Segment
from ..core.settings import GenerationConfig
from .longdoc import LongDocument
from .metrics import normalize, score
from .prompt import SYSTEM

LONG_MODES = ("long-context", "rag-only", "rapid")
DEFAULT_LONG_MODES = ("long-context", "rag-only", "rapid:0", "rapid")
DEFAULT_ETA_GRID = (0.0, 0.5, 1.0, 2.0, 4.0)


def template(context: str, question: str) -> str:
    """The user turn of every mode: the evaluation harness's "Context / Question" layout."""
    return f"Context:\n{context}\n\nQuestion: {question}"


def is_long_mode(name: str) -> bool:
    return name.strip().partition(":")[0] in LONG_MODES


@dataclass(frozen=True)
class LongMode:
    name: str
    kind: str  # long-context | rag-only | rapid
    eta: float | None = None  # rapid: None until chosen on the dev set

    @classmethod
    def parse(cls, name: str) -> "LongMode":
        name = name.strip()
        kind, colon, arg = name.partition(":")
        if kind not in LONG_MODES:
            raise ValueError(f"unknown long-document mode {name!r}: use long-context, rag-only, "
                             "rapid (η chosen on the dev set) or rapid:η (e.g. rapid:0.5)")
        if kind != "rapid":
            if colon:
                raise ValueError(f"mode {name!r}: only rapid takes an argument (rapid:η)")
            return cls(name, kind)
        if not colon:
            return cls(name, kind, None)
        return cls(name, kind, parse_eta(arg, name))


def parse_eta(text: str, mode: str | None = None) -> float:
    """η from text: a finite number ≥ 0 (RapidEngine's documented range)."""
    where = f"mode {mode!r}: " if mode else ""
    try:
        eta = float(text)
    except ValueError:
        raise ValueError(f"{where}η must be a number ≥ 0, e.g. rapid:0.5, not {text!r}") from None
    if not math.isfinite(eta) or eta < 0:
        raise ValueError(f"{where}η must be finite and ≥ 0 (0 is lossless), not {text!r}")
    return eta


def parse_eta_grid(text: str) -> tuple[float, ...]:
    grid = tuple(sorted({parse_eta(t.strip()) for t in text.split(",") if t.strip()}))
    if not grid:
        raise ValueError("the η grid is empty: give comma-separated values such as 0,0.5,1,2,4")
    return grid


def choose_eta(accuracy: dict[float, float]) -> float:
    """The η of the highest accuracy; among equals the smallest (closest to lossless)."""
    if not accuracy:
        raise ValueError("no η was evaluated")
    best = max(accuracy.values())
    return min(eta for eta, acc in accuracy.items() if acc == best)


def evidence_found(evidence: Sequence[str], chunks: Sequence[str]) -> bool:
    """Every evidence sentence occurs whole in one of the chunks (no evidence: True)."""
    return all(any(s in c for c in chunks) for s in evidence)


def _answer(rapid, mode: LongMode, doc: LongDocument, question: str, chunks: list[str],
            prefix_blob, config: GenerationConfig, gamma: int | None):
    """(reply, stats) of one mode on one question."""
    if mode.kind == "long-context":
        target = rapid.target
        prefix, suffix = rapid.render(target, doc.document, question)
        # the document's blob (encoded from position 0: exactly a full prefill of it) + question
        return target.generate([Segment(prefix, prefix_blob), Segment(suffix)], config=config,
                               mode="turbo")
    if mode.kind == "rag-only":
        drafter = rapid.drafter
        prefix, suffix = rapid.render(drafter, "\n\n".join(chunks), question)
        return drafter.generate(prefix + suffix, chunks=chunks, config=config, mode="turbo",
                                encode_missing=True)
    return rapid.generate(doc.document, question, chunks=chunks, config=config, gamma=gamma,
                          eta=mode.eta)


def run_modes(rapid, docs: Sequence[LongDocument], modes: Sequence[LongMode], *,
              max_new_tokens: int = 32, gamma: int | None = None,
              progress: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Answer every question of every document in every mode (η fixed). Returns (rows, skipped).

    Documents are processed one at a time: the document's prefix blob is encoded once and every
    mode of every question reuses it (nothing of it is timed in tokens/s).
    """
    if any(m.kind == "rapid" and m.eta is None for m in modes):
        raise ValueError("choose η first: run_modes takes rapid modes with a fixed η")
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop=("\n",))
    rows, skipped = [], []
    for doc in docs:
        prefix, suffix = rapid.render(rapid.target, doc.document, doc.questions[0].question)
        try:
            for q in doc.questions:
                rapid.check_target_window(*rapid.render(rapid.target, doc.document, q.question),
                                          max_new_tokens)
        except ContextWindowError as exc:
            skipped.append({"doc_id": doc.doc_id, "reason": str(exc)})
            continue
        # The target's context, once per document: the same key RAPID's prefix cache looks up.
        blob = rapid.target.library.prefix_blob(prefix)
        for q in doc.questions:
            chunks = rapid.drafter_context(doc.document, q.question).chunks
            found = evidence_found(q.evidence, chunks)
            reference = None
            for mode in sorted(modes, key=lambda m: m.kind != "long-context"):
                res = _answer(rapid, mode, doc, q.question, chunks, blob, config, gamma)
                text = res.text.strip()
                st = res.stats
                row = {"doc_id": doc.doc_id, "id": q.id, "kind": q.kind, "mode": mode.name,
                       "eta": mode.eta, "question": q.question, "answer": text,
                       "answers": q.answers, "correct": score(text, q.answers)["contains"],
                       "evidence_retrieved": found, "drafter_chunks": len(chunks),
                       "new_tokens": st.new_tokens, "decode_s": st.decode_s,
                       "ttft_s": st.ttft_s}
                if mode.kind == "rapid":
                    row.update(drafted=st.drafted, accepted=st.accepted,
                               drafter_prompt_tokens=st.drafter_prompt_tokens,
                               target_prompt_tokens=st.target_prompt_tokens,
                               target_prefix_hit=st.target_prefix_hit)
                if mode.kind == "long-context":
                    reference = (text, list(res.token_ids))
                elif reference is not None:
                    row["identical_to_long_context"] = float(text == reference[0])
                    row["agrees_with_long_context"] = float(normalize(text)
                                                            == normalize(reference[0]))
                rows.append(row)
                if progress:
                    progress(f"{doc.doc_id} {q.id} {mode.name}: {text[:60]!r}")
    return rows, skipped


def summarise(rows: Iterable[dict]) -> dict[str, dict]:
    """Per mode: accuracy overall and by question kind, agreement with long-context, decode
    tokens/s (all decode steps over all decode time: the first token of a reply comes from the
    prefill), RAPID's acceptance rate."""
    by_mode: dict[str, list[dict]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    out = {}
    for name, rs in by_mode.items():
        steps = sum(max(r["new_tokens"] - 1, 0) for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        hard = [r for r in rs if r["kind"] != "direct"]
        missed = [r for r in rs if not r["evidence_retrieved"]]
        agree = [r["agrees_with_long_context"] for r in rs if "agrees_with_long_context" in r]
        same = [r["identical_to_long_context"] for r in rs if "identical_to_long_context" in r]
        m = {"n": len(rs), "eta": rs[0]["eta"],
             "accuracy": 100 * sum(r["correct"] for r in rs) / len(rs),
             "accuracy_direct": _pct([r["correct"] for r in rs if r["kind"] == "direct"]),
             "accuracy_hard": _pct([r["correct"] for r in hard]),
             "accuracy_evidence_missed": _pct([r["correct"] for r in missed]),
             "n_evidence_missed": len(missed),
             "agreement_long_context": _pct(agree), "identical_long_context": _pct(same),
             "decode_tokens_per_s": steps / secs if secs > 0 else None,
             "median_ttft_s": statistics.median(r["ttft_s"] for r in rs)}
        drafted = sum(r.get("drafted", 0) for r in rs)
        if any("drafted" in r for r in rs):
            m["acceptance_rate"] = sum(r["accepted"] for r in rs) / drafted if drafted else None
        out[name] = m
    return out


def _pct(xs: Sequence[float]) -> float | None:
    return 100 * sum(xs) / len(xs) if xs else None


def check_disjoint(dev: Sequence[LongDocument], docs: Sequence[LongDocument]) -> None:
    """The dev set that chooses η must not share a document with the evaluated set."""
    texts = {d.document for d in dev}
    shared = [d.doc_id for d in docs if d.document in texts]
    if shared:
        raise ValueError(f"the dev set that chooses η contains evaluated documents ({shared}): "
                         "evaluate a held-out set, e.g. the bundled longdoc/test.jsonl")


def evaluate_long(rapid, docs: Sequence[LongDocument], modes: Iterable[str], *,
                  dev_docs: Sequence[LongDocument] | None = None,
                  eta_grid: Sequence[float] = DEFAULT_ETA_GRID, max_new_tokens: int = 32,
                  gamma: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Choose η on `dev_docs` (when a `rapid` mode asks for it), then run every mode on `docs`.

    Returns {"modes": summary per mode, "answers": rows, "skipped": [...], "eta_chosen",
    "dev": {"modes": summary per grid η, "answers": rows} or None}.
    """
    specs = [LongMode.parse(m) for m in modes]
    if not specs:
        raise ValueError("no modes given")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"a mode is named twice in {names}")
    dev, chosen = None, None
    if any(s.kind == "rapid" and s.eta is None for s in specs):
        if not dev_docs:
            raise ValueError("mode 'rapid' chooses η on a dev set: give one (or use rapid:η)")
        check_disjoint(dev_docs, docs)
        grid = [LongMode(f"rapid:{e:g}", "rapid", float(e)) for e in eta_grid]
        dev_rows, dev_skipped = run_modes(rapid, dev_docs, grid, max_new_tokens=max_new_tokens,
                                          gamma=gamma, progress=progress)
        dev_summary = summarise(dev_rows)
        if not dev_summary:
            raise ValueError(f"no dev document fits the target's window: {dev_skipped}")
        chosen = choose_eta({m["eta"]: m["accuracy"] for m in dev_summary.values()})
        dev = {"modes": dev_summary, "answers": dev_rows, "skipped": dev_skipped,
               "eta_grid": list(eta_grid)}
        specs = [LongMode(s.name, s.kind, chosen) if s.kind == "rapid" and s.eta is None else s
                 for s in specs]
    rows, skipped = run_modes(rapid, docs, specs, max_new_tokens=max_new_tokens, gamma=gamma,
                              progress=progress)
    summary = summarise(rows)
    ordered = {s.name: summary[s.name] for s in specs if s.name in summary}
    return {"modes": ordered, "answers": rows, "skipped": skipped, "eta_chosen": chosen,
            "dev": dev, "gamma": gamma if gamma is not None else rapid.config.speculation.gamma,
            "max_new_tokens": max_new_tokens}


def long_table(results: dict) -> str:
    """Markdown: one row per mode."""
    def f(x, fmt="{:.1f}"):
        return "—" if x is None else fmt.format(x)

    lines = ["| mode | η | accuracy % | direct % | alias + two-hop % | correct where evidence not retrieved % "
             "| same as long-context % | decode tok/s | acceptance % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["modes"].items():
        acc = m.get("acceptance_rate")
        lines.append(
            f"| {name} | {f(m['eta'], '{:g}')} | {m['accuracy']:.1f} | {f(m['accuracy_direct'])} | "
            f"{f(m['accuracy_hard'])} | {f(m['accuracy_evidence_missed'])} "
            f"(n={m['n_evidence_missed']}) | {f(m['identical_long_context'])} | "
            f"{f(m['decode_tokens_per_s'])} | {f(None if acc is None else 100 * acc)} |")
    return "\n".join(lines) + "\n"


def make_rapid(target, drafter=None, *, gamma: int = 5, **kwargs):
    """The RapidEngine the evaluation uses: the evaluation prompt (system instruction, "Context /
    Question" turn) and the engine's own retrieval settings unless given."""
    from ..core.rapid import RapidEngine

    return RapidEngine(target, drafter, gamma=gamma, template=template, system=SYSTEM, **kwargs)
