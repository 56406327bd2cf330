"""Evaluate TurboRAG modes on a JSONL RAG set: accuracy, agreement with a full prefill, TTFT.

Input lines: {"id", "question", "answers": [...], "chunks": [texts], "gold": [indices]}, and
optionally "unanswerable": true (then "answers" may be empty: the context lacks the fact) and
"contexts": [texts], each chunk's document text before it, when the chunks are not in their
document's order (else a chunk is encoded after the item's chunks before it). Other keys are
ignored. For each mode every item is answered greedily and scored:

- correct: the headline figure — an answerable item is correct when its reply contains an answer,
  an unanswerable one when its reply refuses (`metrics.is_refusal`)
- contains: a normalised answer occurs in the normalised reply (whole words), answerable items
- em / f1: exact match and token F1 against the best answer (SQuAD normalisation)
- agreement with the full prefill, against the `naive` reply on that item; None for `naive`
  itself, the reference, and absent without a naive mode in the run:
  - agreement: the share of items whose reply equals (normalised) the naive reply (per row
    "agrees_with_naive")
  - correct_agreement: the share whose `correct` equals the naive reply's (row "correct_agrees")
  - reply_kl / reply_top1 (token_agreement=True): the naive reply's tokens teacher-forced through
    both paths; at each reply position, KL(naive ‖ mode) of the next-token distributions in
    nats, and whether their most likely tokens are the same (evaluation/agreement.py). Per row
    the mean KL and the top-1 share (%) over the reply; per mode their means over the items.
    None for an item whose naive reply is empty. Costs one prefill and one forward per item and
    mode (and per item for the naive reference), outside the timings
- ttft_s: median time to first token (blob loading, stitching, recovery and prefill included;
  blobs are encoded beforehand and not timed), reused_fraction: mean reused / prompt tokens

Modes: "naive" (full prefill), "turbo" (stitched, the engine's default recovery), turbo with
a recovery of its own ("turbo+none": the
stitched prefill alone, "turbo+select:0.3", "turbo+boundary:16", "turbo+blend:0.15"), with a chunk anchor
other than the engine's ("turbo@none", "turbo@bos", "turbo@chat", or "turbo@head": the evaluation
prompt's own head, known at ingestion here), with a chunk encoder other than the engine's
("turbo#none": training-free; "turbo#FILE": that learned encoder file; one full-prefill
reference serves them all, since an encoder never changes the model). Two references say what
agreement can be: "naive-rotated" (a full prefill of the same chunks in another order, the first
moved last: how much the model's reply moves with an order no retriever guarantees) and
"turbo-oracle" (the stitched path fed slices of the full prefill's own cache: the reply of
stitching itself, with exact keys and values; 100% agreement unless the stitched prompt differs
from the full one).

Every mode averages the same items: an item that does not fit the context window of one mode
(the prompt's check before any generation, or a stitched prompt that tokenizes longer than the
whole one) is skipped in every mode, listed under "skipped" with the reason, and none of its
replies is counted or written.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..core.prefill.context import text_before
from ..core.errors import ContextWindowError
from ..core.settings import GenerationConfig
from ..core.request import Request
from .agreement import reply_logits, token_agreement
from .jsonl import read_jsonl
from .metrics import is_refusal, normalize, score
from .prompt import SYSTEM, build_prompt, prompt_head

log = logging.getLogger(__name__)

# the full prefill, the default (query-aware recompute), the stitched prefill alone, and the
# frontier's other recoveries at a like budget
DEFAULT_MODES = ("naive", "turbo", "turbo+none", "turbo+boundary:16", "turbo+blend:0.15")


@dataclass
class Item:
    id: str
    question: str
    answers: list[str]
    chunks: list[str]
    gold: list[int] = field(default_factory=list)
    line: int = 0
    unanswerable: bool = False
    template: str | None = None  # training mixes: the prompt template (training/templates.py)
    # each chunk's document text before it, for chunks out of their document's order
    contexts: list[str] | None = None


@dataclass
class LoadReport:
    items: list[Item]
    errors: list[tuple[int, str]]  # (line number, reason)


def load_items(path: str | Path) -> LoadReport:
    """Read the JSONL set; malformed lines are reported with their line numbers and skipped."""
    return LoadReport(*read_jsonl(path, _item))


def _item(d: dict, n: int) -> Item:
    q, answers, chunks = d.get("question"), d.get("answers"), d.get("chunks")
    if not isinstance(q, str) or not q.strip():
        raise ValueError("'question' must be a non-empty string")
    if isinstance(answers, str):
        answers = [answers]
    unanswerable = d.get("unanswerable", False)
    if not isinstance(unanswerable, bool):
        raise ValueError("'unanswerable' must be true or false")
    if answers is None and unanswerable:
        answers = []
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError("'answers' must be a list of strings")
    if not answers and not unanswerable:
        raise ValueError("'answers' is empty: give at least one answer, or mark the "
                         "item \"unanswerable\": true")
    if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
        raise ValueError("'chunks' must be a list of strings")
    gold = d.get("gold") or []
    contexts = d.get("contexts")
    if contexts is not None:
        if not isinstance(contexts, list) or len(contexts) != len(chunks) or not all(
                isinstance(c, str) for c in contexts):
            raise ValueError("'contexts' must be a list of strings, one per chunk ('' for none)")
        contexts = [ctx for c, ctx in zip(chunks, contexts) if c.strip()]
    return Item(str(d.get("id", f"line{n}")), q, answers, [c for c in chunks if c.strip()],
                list(gold), n, unanswerable, d.get("template") or None, contexts)


@dataclass(frozen=True)
class ModeSpec:
    name: str
    mode: str  # naive | turbo
    recovery: str | None
    anchor: str | None = None  # None: the engine's own
    encoder: str | None = None  # None: the engine's own; "none" or an encoder file otherwise
    context: int | None = None  # context tokens chunks are encoded after; None: the engine's own
    # references: "rotated" (a full prefill of the prompt with its chunks in another order) and
    # "oracle" (the stitched path fed slices of the full prefill's own cache)
    reference: str | None = None

    @property
    def is_full_prefill(self) -> bool:
        """The mode every other is compared with: a full prefill of the prompt as written."""
        return self.mode == "naive" and self.reference is None

    @classmethod
    def parse(cls, name: str) -> "ModeSpec":
        body = name.strip()
        body, _, encoder = body.partition("#")
        if encoder and encoder != "none" and not Path(encoder).is_file():
            raise ValueError(f"mode {name!r}: the encoder after '#' must be 'none' or an "
                             f"encoder file; {encoder!r} is neither")
        body, tilde, context = body.partition("~")
        if tilde and not context.isdigit():
            raise ValueError(f"mode {name!r}: after '~' give the context tokens chunks are "
                             f"encoded after, a whole number (0: none), not {context!r}")
        body, _, anchor = body.partition("@")
        if anchor and anchor not in ANCHOR_MODES:
            raise ValueError(f"unknown anchor in mode {name!r}: use one of {ANCHOR_MODES}")
        base, _, rec = body.partition("+")
        if base in REFERENCE_MODES:
            if rec or anchor or encoder or tilde:
                raise ValueError(f"mode {name!r}: the reference modes {REFERENCE_MODES} take "
                                 "no recovery, anchor, encoder or context")
            return cls(base, REFERENCE_MODES[base], None,
                       reference=base.partition("-")[2])
        if base not in ("naive", "turbo"):
            raise ValueError(f"unknown mode {name!r}: use naive or turbo, optionally "
                             "'+RECOVERY' (turbo only)")
        if base == "naive" and (rec or anchor or encoder or tilde):
            raise ValueError(f"mode {name!r}: recovery, anchors, contexts and encoders apply "
                             "to turbo modes only (a full prefill uses no blob)")
        Request("", recovery=rec or None)  # a bad spec fails now, as a request would refuse it
        return cls(name.strip(), base, rec or None,
                   anchor or None, encoder or None, int(context) if tilde else None)


ANCHOR_MODES = ("none", "bos", "chat", "head")
# What agreement with the full prefill can be: the same model over the same chunks in another
# order (the first moved last), and the stitched path over exact KV (slices of the full
# prefill's cache: equal replies unless stitching changed the tokens or the arithmetic).
REFERENCE_MODES = {"naive-rotated": "naive", "turbo-oracle": "turbo"}


def oracle_segments(engine, prompt: str, chunks: Sequence[str]) -> list:
    """The engine's segments of `prompt`, each stored blob (chunks, separators, the head)
    replaced by the slice of a full causal prefill of the prompt at its place."""
    from ..core.kv.blob import KVBlob
    from ..core.prefill.stitch import Segment, plan_prompt

    segments, _, _ = engine.assembly.segments(prompt, chunks)
    plan = plan_prompt(segments, engine.tokenizer)
    [whole] = engine.library.prefix_encoder.encode_ids([plan.token_ids])
    starts = iter(span.prompt_start for span in plan.spans)
    out = []
    for seg in segments:
        if seg.cached:
            a = next(starts)
            n = seg.blob.num_tokens
            seg = Segment(seg.text, KVBlob(whole.token_ids[a:a + n], whole.keys[:, :, a:a + n],
                                           whole.values[:, :, a:a + n], whole.fingerprint, a))
        out.append(seg)
    return out


def _sibling(engine, anchor: str | None, encoder: str | None, head: str,
             context: int | None = None):
    """The engine itself, or a sibling on the same model and store with another chunk anchor,
    chunk encoder or context (one model in memory, one full-prefill reference for all)."""
    spec = engine.anchor if anchor is None else head if anchor == "head" else anchor
    own_context = engine.library.encoder.context_tokens
    context = own_context if context is None else context
    if encoder is None and context == own_context and (
            spec == engine.anchor or (anchor == "head" and engine.anchor_text == head)):
        return engine
    from ..core.engine import TurboRAGEngine

    # Without an encoder named, a sibling keeps the parent's learned encoder where it was
    # trained after that anchor, and encodes training-free (encoder=None) after any other.
    if encoder is not None:
        chosen = None if encoder == "none" else encoder
    else:
        learned = getattr(engine, "learned", None)
        chosen = learned if learned is not None and learned.anchor == spec else None
    return TurboRAGEngine(engine.loaded, store=engine.store, progress=False, anchor=spec,
                          encoder=chosen, context_tokens=context)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def evaluate(engine, items: Sequence[Item], modes: Iterable[str], *, max_new_tokens: int = 24,
             progress: Callable[[str, int, int], None] | None = None,
             limit: int | None = None, token_agreement: bool = True,
             system: str = SYSTEM) -> dict:
    """Run every mode over the items; return {"modes": {...}, "answers": [...], "skipped": [...]}.

    token_agreement: also measure reply_kl / reply_top1 against the naive reply (one extra
    prefill and forward per item and mode). system: the prompt's system instruction (every
    mode's prompt, and the text the "head" anchor encodes chunks after)."""
    if not system.strip():
        raise ValueError("the system instruction is empty: give one, or leave the default")
    specs = [ModeSpec.parse(m) for m in modes]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"a mode is named twice in {names}")
    # the naive mode first, so every other mode can be compared with its reply
    specs.sort(key=lambda s: not s.is_full_prefill)
    items = list(items)[:limit] if limit else list(items)
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop=("\n",))
    # Build prompts and check the window once.
    prepared: dict[str, tuple[str, list[str]]] = {}
    skipped: dict[str, str] = {}
    for it in items:
        prompt, texts = build_prompt(engine.tokenizer, it.question, it.chunks, system=system)
        n = len(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if n + max_new_tokens > engine.context_window:
            skipped[it.id] = (f"prompt of {n} tokens + {max_new_tokens} to generate exceeds "
                              f"the context window of {engine.context_window}")
            continue
        prepared[it.id] = (prompt, texts)
    # each chunk after the text before it in its item's document: the item's own
    # `contexts` where it gives them (its chunks in another order than their document's),
    # else the item's chunks are one document's, in order: the chunks before it, nearest
    # first. A chunk in several items keeps its first context, as ingestion keeps the first
    # blob of a text.
    given = {it.id: it.contexts for it in items if it.contexts is not None}
    before: dict[str, list[str]] = {}
    for item_id, (_, texts) in prepared.items():
        own = given.get(item_id)
        if own is not None and len(own) != len(texts):
            raise ValueError(f"item {item_id}: {len(own)} contexts for {len(texts)} chunks")
        for i, text in enumerate(texts):
            if own is not None:
                pieces = [own[i]] if own[i] else []
            else:
                pieces = texts[i - 1::-1] if i else []
            before.setdefault(text, pieces)
    chunks = sorted(before)
    head = prompt_head(engine.tokenizer, system)
    engines: dict[ModeSpec, object] = {}
    siblings: dict = {}
    for spec in specs:
        key = (spec.anchor, spec.encoder, spec.context)
        engines[spec] = siblings.get(key) or siblings.setdefault(
            key, _sibling(engine, spec.anchor, spec.encoder, head, spec.context))
    served: dict[int, tuple] = {}  # id(engine) -> (engine, the turbo modes on its blobs)
    for s in specs:
        if s.mode == "turbo":
            served.setdefault(id(engines[s]), (engines[s], []))[1].append(s.name)
    for e, names in served.values():
        if chunks:  # ingestion: not part of TTFT; minutes for a larger model
            label = f"encoding chunks for {', '.join(names)}"
            tokens = e.library.encoder.context_tokens
            e.encode_chunks(chunks, contexts=[text_before(before[c], c, tokens)
                                              for c in chunks], progress=(
                (lambda done, total, label=label: progress(label, done, total))
                if progress else None))
    engine.warmup()
    todo = [it for it in items if it.id not in skipped]
    rows_of: dict[str, list[dict]] = {}
    naive_reply: dict[str, str] = {}
    naive_correct: dict[str, float] = {}
    naive_ids: dict[str, list[int]] = {}  # empty: an empty reply
    for spec in specs:
        eng = engines[spec]
        rows = rows_of[spec.name] = []
        for i, it in enumerate(todo):
            if it.id in skipped:  # did not fit an earlier mode: out of every mode
                continue
            prompt, texts = prepared[it.id]
            if spec.reference == "rotated":  # the same chunks, the first one moved last
                prompt, texts = build_prompt(eng.tokenizer, it.question,
                                             it.chunks[1:] + it.chunks[:1], system=system)
            elif spec.reference == "oracle":
                prompt = oracle_segments(eng, prompt, texts)
            try:
                res = eng.generate(prompt, chunks=texts if spec.mode == "turbo" else (),
                                   config=config, mode=spec.mode, recovery=spec.recovery)
            except ContextWindowError as exc:
                skipped[it.id] = f"{spec.name}: {exc}"
                continue
            text = res.text.strip()
            st = res.stats
            refused = is_refusal(text)
            scores = score(text, it.answers) if it.answers else {"em": 0.0, "f1": 0.0,
                                                                 "contains": 0.0}
            correct = float(refused) if it.unanswerable else scores["contains"]
            row = {"id": it.id, "mode": spec.name, "answer": text, "answers": it.answers,
                   "unanswerable": it.unanswerable, "refused": refused, "correct": correct,
                   **scores, "ttft_s": st.ttft_s,
                   "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
                   "new_tokens": st.new_tokens}
            key = it.id
            if spec.is_full_prefill:  # the reference: its agreement with itself says nothing
                naive_reply[key] = normalize(text)
                naive_correct[key] = correct
                naive_ids[key] = list(res.token_ids) if text else []
            elif key in naive_reply:
                row["agrees_with_naive"] = float(normalize(text) == naive_reply[key])
                row["correct_agrees"] = float(correct == naive_correct[key])
            rows.append(row)
            if progress:
                progress(spec.name, i + 1, len(todo))
    if token_agreement:  # after every mode ran: only the items no mode skipped
        _token_agreement(specs, engines, todo, skipped, prepared, rows_of, naive_ids)
    # An item a later mode skipped is dropped from the earlier modes too.
    answers: list[dict] = []
    per_mode: dict[str, dict] = {}
    for spec in specs:
        rows = [r for r in rows_of[spec.name] if r["id"] not in skipped]
        answers.extend(rows)
        per_mode[spec.name] = _summary(rows)
    naive_ttft = per_mode.get("naive", {}).get("ttft_s")
    for m in per_mode.values():
        m["speedup_vs_naive"] = (naive_ttft / m["ttft_s"]) if naive_ttft and m["ttft_s"] else None
    return {"modes": per_mode, "answers": answers,
            "skipped": [{"id": k, "reason": v} for k, v in skipped.items()]}


def _token_agreement(specs, engines, items, skipped, prepared, rows_of, naive_ids) -> None:
    """Fill in reply_kl / reply_top1 on the rows of every mode compared with a naive reply.

    Item by item: the naive reference logits are computed once per item and serve every mode
    (only one item's are held at a time)."""
    rows = {(r["mode"], r["id"]): r for rs in rows_of.values() for r in rs}
    ref_spec = next((s for s in specs if s.is_full_prefill), None)
    if ref_spec is None:
        return
    for it in items:
        if it.id in skipped:
            continue
        others = [s for s in specs if not s.is_full_prefill and (s.name, it.id) in rows]
        ids = naive_ids.get(it.id)
        if not others or ids is None:
            continue
        if not ids:  # an empty naive reply: no positions to compare
            for spec in others:
                rows[spec.name, it.id].update(reply_kl=None, reply_top1=None)
            continue
        prompt, texts = prepared[it.id]
        reference = reply_logits(engines[ref_spec], prompt, ids, mode="naive")
        for spec in others:
            if spec.reference == "rotated":
                continue  # another prompt: its reply is compared, not its distributions
            own = oracle_segments(engines[spec], prompt, texts) \
                if spec.reference == "oracle" else prompt
            logits = reply_logits(engines[spec], own, ids, chunks=texts, mode=spec.mode,
                                  recovery=spec.recovery)
            kl, top1 = token_agreement(reference, logits)
            rows[spec.name, it.id].update(reply_kl=kl, reply_top1=top1)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _summary(rows: list[dict]) -> dict:
    n = len(rows) or 1
    agree = [r["agrees_with_naive"] for r in rows if "agrees_with_naive" in r]
    correct_agree = [r["correct_agrees"] for r in rows if "correct_agrees" in r]
    ans = [r for r in rows if not r["unanswerable"]]
    una = [r for r in rows if r["unanswerable"]]
    na = len(ans) or 1
    return {
        "n": len(rows),
        "n_unanswerable": len(una),
        "correct": 100 * sum(r["correct"] for r in rows) / n,
        "contains": 100 * sum(r["contains"] for r in ans) / na,
        "em": 100 * sum(r["em"] for r in ans) / na,
        "f1": 100 * sum(r["f1"] for r in ans) / na,
        "refused_unanswerable": (100 * sum(r["refused"] for r in una) / len(una)
                                 if una else None),
        "refused_answerable": 100 * sum(r["refused"] for r in ans) / na,
        "agreement": 100 * sum(agree) / len(agree) if agree else None,
        "correct_agreement": (100 * sum(correct_agree) / len(correct_agree)
                              if correct_agree else None),
        "reply_kl": _mean([r.get("reply_kl") for r in rows]),
        "reply_top1": _mean([r.get("reply_top1") for r in rows]),
        "ttft_s": _median([r["ttft_s"] for r in rows]),
        "reused_fraction": sum(r["reused_tokens"] / r["prompt_tokens"] for r in rows) / n,
        "prompt_tokens": _median([r["prompt_tokens"] for r in rows]),
    }


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(results: dict) -> str:
    """One line per mode: accuracy and, beside it, agreement with the full prefill (naive)."""
    lines = ["| mode | correct % | same reply as full % | correctness agrees % | reply KL | "
             "reply top-1 % | contains % | EM % | F1 % | refused unanswerable % | "
             "median TTFT s | TTFT speed-up | reused % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["modes"].items():
        lines.append(
            f"| {name} | {m.get('correct', m['contains']):.1f} | "
            f"{_fmt(m.get('agreement'), '.1f')} | {_fmt(m.get('correct_agreement'), '.1f')} | "
            f"{_fmt(m.get('reply_kl'), '.3g')} | {_fmt(m.get('reply_top1'), '.1f')} | "
            f"{m['contains']:.1f} | {m['em']:.1f} | {m['f1']:.1f} | "
            f"{_fmt(m.get('refused_unanswerable'), '.0f')} | {m['ttft_s']:.3f} | "
            f"{_fmt(m.get('speedup_vs_naive'), '.1f', 'x')} | "
            f"{100 * m['reused_fraction']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str | Path) -> str | None:
    """The accuracy/speed frontier: correct % (left) and same-reply-as-full % (right) against
    the TTFT speed-up over naive (log), one labelled point per mode. Returns a message when
    skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped (pip install matplotlib)"
    from matplotlib.ticker import FuncFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    panels = ((left, "correct", "correct %", "accuracy (answers contained, unanswerable refused)"),
              (right, "agreement", "same reply as full %", "agreement with the full prefill"))
    speed = FuncFormatter(lambda v, _: f"{v:g}x")
    for ax, key, label, title in panels:
        for i, (name, m) in enumerate(results["modes"].items()):
            x, y = m.get("speedup_vs_naive"), m.get(key)
            if key == "agreement" and y is None and name == "naive":
                y = 100.0  # the reference is its own full prefill
            if x is None or y is None:
                continue
            ax.scatter(x, y, color=f"C{i % 10}")  # one colour per mode in both panels
            ax.annotate(name, (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(speed)
        ax.xaxis.set_minor_formatter(speed)
        ax.set_xlabel("TTFT speed-up vs naive (log)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_results(results: dict, out: str | Path, *, table: bool = True,
                  png: bool = False) -> list[str]:
    """results.json, answers.jsonl (one line per item and mode), table.md, plot.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    summary = {k: v for k, v in results.items() if k != "answers"}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    with open(out / "answers.jsonl", "w", encoding="utf-8") as f:
        for row in results["answers"]:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    if table:
        (out / "table.md").write_text(markdown_table(results))
    if png:
        msg = plot(results, out / "plot.png")
        if msg:
            notes.append(msg)
    return notes


def temporary_store():
    """A throwaway KV store folder for one evaluation run."""
    return tempfile.TemporaryDirectory(prefix="turborag-eval-")
