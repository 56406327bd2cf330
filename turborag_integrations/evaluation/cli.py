"""`turborag eval`: a typer command function the main app registers.

    app.command("eval")(eval_command)

`fail` and the bundled data paths serve `turborag finetune --encoder` (training/cli.py) too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

DEVSET = Path(__file__).resolve().parents[1] / "data" / "devset"
# Hand-written, never trained on or used to choose settings: report on it once.
HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout" / "heldout.jsonl"
# Hand-written too, for choosing settings (encoder candidates, steps, recovery) before HELDOUT.
HANDDEV = Path(__file__).resolve().parents[1] / "data" / "handdev" / "handdev.jsonl"
# Long documents for RAPID's modes: dev chooses η, test is reported (evaluation/longdoc.py).
LONGDOC = Path(__file__).resolve().parents[1] / "data" / "longdoc"


def fail(message: str, code: int = 2) -> None:
    """Print `message` as an error on stderr and exit with `code` (2: bad input)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def eval_command(
    data: Optional[Path] = typer.Argument(None, help="JSONL set: id, question, answers, chunks "
                                          "(default: the bundled devset test split); for the "
                                          "long-document modes a long-document set (default: "
                                          "the bundled longdoc test split)"),
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    encoder: str = typer.Option("default", help="chunk encoder the blobs are made with: "
                                "'default' (the one shipped for the model), 'none' (the "
                                "query-time model itself), or a path"),
    context_tokens: Optional[int] = typer.Option(
        None, min=0, help="encode each chunk after up to this many tokens of its item's chunks "
                          "before it (0: alone; default: the engine's); a mode's '~N' overrides "
                          "it"),
    modes: Optional[str] = typer.Option(
        None, help="comma-separated: naive, turbo (the default recovery), "
                   "turbo+RECOVERY (none, select:R, select:auto, first, boundary:K, "
                   "blend:R); a turbo mode may add @ANCHOR, ~N (context "
                   "tokens) and #ENCODER; or, on a long-document set, long-context, "
                   "rag-only, rapid:η, rapid (η chosen on --dev). Default: "
                   "naive,turbo,turbo+none,turbo+boundary:16,turbo+blend:0.15, or "
                   "long-context,rag-only,rapid:0,rapid on a long-document set"),
    out: Path = typer.Option(Path("eval-out"), help="folder for results.json, answers.jsonl, "
                             "table.md, plot.png"),
    max_new_tokens: int = typer.Option(24),
    system: Optional[str] = typer.Option(
        None, help="the prompt's system instruction (default: evaluation/prompt.py's SYSTEM), "
                   "e.g. one that asks for a refusal when the context lacks the answer"),
    limit: Optional[int] = typer.Option(None, help="evaluate the first N items "
                                        "(long-document sets: documents) only"),
    table: bool = typer.Option(True, help="write and print a markdown table"),
    plot: bool = typer.Option(False, help="write plot.png: correct % and same-reply-as-full % "
                              "against the TTFT speed-up vs naive, per mode (needs matplotlib)"),
    token_agreement: bool = typer.Option(True, "--token-agreement/--no-token-agreement",
                                         help="also measure the reply KL and top-1 agreement "
                                         "with the full prefill, the naive reply teacher-forced "
                                         "(one extra forward per item and mode)"),
    json_out: bool = typer.Option(False, "--json", help="print the results JSON to stdout"),
    dev: Path = typer.Option(LONGDOC / "dev.jsonl", help="long-document modes: the set on which "
                             "mode 'rapid' chooses η (never the evaluated documents)"),
    eta_grid: str = typer.Option("0,0.5,1,2,4", help="long-document modes: the η values mode "
                                 "'rapid' tries on --dev"),
    dev_limit: Optional[int] = typer.Option(None, help="long-document modes: choose η on the "
                                            "first N documents of --dev only"),
    gamma: int = typer.Option(5, help="long-document modes: RAPID's drafts per round"),
    drafter: Optional[str] = typer.Option(None, help="long-document modes: the drafter model "
                                          "(same vocabulary as --model); default: the model "
                                          "drafts for itself"),
):
    """Accuracy and TTFT of TurboRAG modes (recovery and chunk encoders included) on a RAG set;
    accuracy and decode tokens/s of long-context, RAG-only and RAPID on long documents."""
    from .longdoc import is_long_document_set
    from .rapid_eval import DEFAULT_LONG_MODES, is_long_mode

    mode_list = [m.strip() for m in (modes or "").split(",") if m.strip()]
    long_modes = [m for m in mode_list if is_long_mode(m)]
    if long_modes and len(long_modes) != len(mode_list):
        fail("the long-document modes (long-context, rag-only, rapid, rapid:η) run on a "
             "long-document set and cannot be mixed with TurboRAG modes in one run: "
             f"{', '.join(m for m in mode_list if not is_long_mode(m))}")
    if data is None:
        data = LONGDOC / "test.jsonl" if long_modes else DEVSET / "test.jsonl"
    if not data.exists():
        fail(f"no such file: {data}")
    if not mode_list and is_long_document_set(data):
        mode_list = long_modes = list(DEFAULT_LONG_MODES)
    if long_modes:
        return _eval_long(data, long_modes, model=model, drafter=drafter,
                          dev=dev, dev_limit=dev_limit, eta_grid=eta_grid, gamma=gamma, out=out,
                          max_new_tokens=max_new_tokens, limit=limit, table=table,
                          json_out=json_out)
    if is_long_document_set(data):
        fail(f"{data} is a long-document set: use the modes long-context, rag-only, rapid:η, "
             "rapid")
    from ..core.engine import TurboRAGEngine
    from ..core.errors import TurboRAGError
    from ..core.models import DEFAULT_MODEL
    from .harness import (DEFAULT_MODES, evaluate, load_items, markdown_table, temporary_store,
                          write_results)

    mode_list = mode_list or list(DEFAULT_MODES)
    from .prompt import SYSTEM

    system = SYSTEM if system is None else system
    report = load_items(data)
    for line, reason in report.errors:
        typer.secho(f"{data}:{line}: skipped malformed line: {reason}", fg=typer.colors.YELLOW,
                    err=True)
    if not report.items:
        fail("no valid items to evaluate")
    try:
        with temporary_store() as kv:
            engine = TurboRAGEngine(model, store=kv, progress=False,
                                    encoder=_encoder_arg(encoder),
                                    **({} if context_tokens is None
                                       else {"context_tokens": context_tokens}))

            def progress(mode, done, total):
                if done == total or done % 10 == 0:
                    typer.echo(f"  {mode}: {done}/{total}", err=True)

            results = evaluate(engine, report.items, mode_list, max_new_tokens=max_new_tokens,
                               progress=progress, limit=limit, token_agreement=token_agreement,
                               system=system)
    except (TurboRAGError, ValueError) as exc:
        fail(str(exc))
    results["malformed_lines"] = [{"line": n, "reason": r} for n, r in report.errors]
    results["data"] = str(data)
    results["model"] = model or DEFAULT_MODEL
    results["anchor"] = engine.anchor
    results["encoder"] = _encoder_arg(encoder)
    results["context_tokens"] = engine.library.encoder.context_tokens
    results["system"] = system
    for s in results["skipped"]:
        typer.secho(f"skipped {s['id']}: {s['reason']}", fg=typer.colors.YELLOW, err=True)
    for note in write_results(results, out, table=table, png=plot):
        typer.secho(note, fg=typer.colors.YELLOW, err=True)
    if json_out:
        json.dump({k: v for k, v in results.items() if k != "answers"}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif table:
        typer.echo(markdown_table(results))
    typer.echo(f"results in {out}/", err=True)


def _encoder_arg(value: str) -> str | None:
    """--encoder as TurboRAGEngine takes it: "none" → None, "default" or a path as given."""
    return None if value == "none" else value


def _eval_long(data: Path, modes: list[str], *, model, drafter, dev: Path, dev_limit,
               eta_grid: str, gamma: int, out: Path, max_new_tokens: int, limit, table: bool,
               json_out: bool) -> None:
    """`turborag eval` on a long-document set: long-context, rag-only and RAPID modes."""
    from ..core.engine import TurboRAGEngine
    from ..core.errors import TurboRAGError
    from ..core.models import DEFAULT_MODEL
    from .harness import temporary_store, write_results
    from .longdoc import load_documents
    from .rapid_eval import LongMode, evaluate_long, long_table, make_rapid, parse_eta_grid

    try:
        specs = [LongMode.parse(m) for m in modes]
        grid = parse_eta_grid(eta_grid)
    except ValueError as exc:
        fail(str(exc))
    docs, errors = load_documents(data)
    for line, reason in errors:
        typer.secho(f"{data}:{line}: skipped malformed line: {reason}", fg=typer.colors.YELLOW,
                    err=True)
    docs = docs[:limit] if limit else docs
    if not docs:
        fail(f"no valid documents in {data} (a long-document set: one JSON line per document "
             "with 'document' and 'questions')")
    dev_docs = None
    if any(s.kind == "rapid" and s.eta is None for s in specs):
        if not dev.exists():
            fail(f"no such dev set: {dev} (mode 'rapid' chooses η on it; or use rapid:η)")
        dev_docs, dev_errors = load_documents(dev)
        if dev_errors or not dev_docs:
            fail(f"{dev}: malformed dev set: {dev_errors[:3] or 'no documents'}")
        dev_docs = dev_docs[:dev_limit] if dev_limit else dev_docs
    try:
        with temporary_store() as kv:
            target = TurboRAGEngine(model, store=kv, progress=False)
            draft = (TurboRAGEngine(drafter, store=target.store, progress=False)
                     if drafter else None)
            rapid = make_rapid(target, draft, gamma=gamma)
            results = evaluate_long(rapid, docs, modes, dev_docs=dev_docs, eta_grid=grid,
                                    max_new_tokens=max_new_tokens,
                                    progress=lambda line: typer.echo(f"  {line}", err=True))
    except (TurboRAGError, ValueError) as exc:
        fail(str(exc))
    results.update(data=str(data), dev=dict(results["dev"] or {}, data=str(dev))
                   if results["dev"] else None, model=model or DEFAULT_MODEL, drafter=drafter,
                   malformed_lines=[{"line": n, "reason": r} for n, r in errors])
    for s in results["skipped"]:
        typer.secho(f"skipped {s['doc_id']}: {s['reason']}", fg=typer.colors.YELLOW, err=True)
    if results["dev"]:  # the dev answers beside the evaluated ones, not inside results.json
        dev_rows = results["dev"].pop("answers")
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "dev_answers.jsonl", "w", encoding="utf-8") as f:
            for row in dev_rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    write_results(results, out, table=False)
    text = long_table(results)
    if results["eta_chosen"] is not None:
        dev_text = long_table(results["dev"])
        text += (f"\nη chosen on {dev}: {results['eta_chosen']:g} (grid {eta_grid})\n\n"
                 f"dev set:\n\n{dev_text}")
    if table:
        (out / "table.md").write_text(text)
    if json_out:
        summary = {k: v for k, v in results.items() if k != "answers"}
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif table:
        typer.echo(text)
    typer.echo(f"results in {out}/", err=True)
